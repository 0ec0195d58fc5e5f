"""`python -m workers.service`: a tokenbus worker (workers/service/process.py)."""
from workers.service.process import main

main()
