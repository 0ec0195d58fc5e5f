"""The worker process, `python -m workers.service` (process.py): the service around the engine
(worker.py) and its parts, one module each (intake, streaming, records, registry), sharing what
state.py holds."""
from workers.service.process import engine_config, main, parser, serve, speculative_config, warm_up
from workers.service.records import USAGE_BACKUP_SECONDS, metered
from workers.service.registry import last_suspect, speculation_of
from workers.service.state import Running
from workers.service.worker import WorkerService

__all__ = ["USAGE_BACKUP_SECONDS", "Running", "WorkerService", "engine_config", "last_suspect", "main", "metered",
           "parser", "serve", "speculation_of", "speculative_config", "warm_up"]
