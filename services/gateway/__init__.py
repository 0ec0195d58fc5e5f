"""The gateway: clients in (websocket /ws, /healthz), GenerateRequests to TB_REQUESTS, detokenized chunks back."""
