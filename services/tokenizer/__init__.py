"""The tokenizer pool: TB_REQUESTS → chat template + encode → TB_ROUTE."""
