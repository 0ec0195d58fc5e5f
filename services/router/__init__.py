"""The router: TB_ROUTE → pick a worker from the heartbeat registry → TB_WORK (tb.work.<worker>)."""
