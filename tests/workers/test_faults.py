"""`--inject-fault NAME=VALUE`: the one way a worker injects faults into itself (tests and chaos only)."""
import pytest

from workers.faults import NO_FAULTS, Faults
from workers.service import parser


def faults(*flags: str) -> Faults:
    args = parser().parse_args(["--model", "m", *(a for f in flags for a in ("--inject-fault", f))])
    return Faults.of(args.inject_fault)


def test_no_fault_is_injected_unless_asked_for():
    assert faults() == NO_FAULTS and not faults()


def test_each_fault_is_parsed_into_its_field_and_the_flag_repeats():
    got = faults("drop-chunks=2, final", "kv-die-after=1", "forward-raise=4001", "forward-exit=7")
    assert got == Faults(frozenset({"2", "final"}), 1, 4001, 7) and got


@pytest.mark.parametrize("flag, why", [
    ("drop-chunk=2", "'drop-chunk=2': unknown fault (known: drop-chunks, kv-die-after, forward-raise, forward-exit)"),
    ("kv-die-after", "'kv-die-after': give kv-die-after=N"),
    ("forward-raise=x", "'forward-raise=x': TOKEN must be a whole number"),
])
def test_a_bad_fault_is_refused_naming_the_flag(flag, why, capsys):
    with pytest.raises(SystemExit):
        faults(flag)
    assert f"argument --inject-fault: {why}" in capsys.readouterr().err
