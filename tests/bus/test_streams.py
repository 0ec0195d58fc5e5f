"""bus/streams.py builds its JetStream configs from schemas/subjects.py's names: the two must agree, or
the permissions (schemas/roles.py, which reads only the names) would not match what the bus creates."""
import bus
from schemas import subjects


def test_streams_are_the_named_streams_in_order():
    assert tuple(c.name for c in bus.STREAMS) == subjects.STREAM_NAMES


def test_stage_consumers_are_the_named_durables():
    assert bus.ROUTER.durable_name == bus.HANDOFFS.durable_name == subjects.ROUTER_DURABLE
    assert bus.ROUTER.filter_subject.startswith(subjects.REQUESTS_SUBJECTS[:-1])       # within TB_REQUESTS
    assert bus.HANDOFFS.filter_subject.startswith(subjects.ROUTE_SUBJECTS[:-1])          # within TB_ROUTE
    assert bus.worker_consumer("w-1").durable_name == subjects.worker_durable("w-1") == "worker-w-1"
    assert bus.worker_consumer("w-1").filter_subject == "tb.work.w-1.*"         # subjects.work("w-1", any id)
