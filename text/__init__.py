"""The text of token streams: incremental, UTF-8-safe detokenization shared by the gateway and the workers."""
