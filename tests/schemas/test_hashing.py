"""The one block hash the engine and the router share."""
from hypothesis import given
from hypothesis import strategies as st

from schemas.hashing import hash_blocks

tokens = st.lists(st.integers(0, 200_000), max_size=100)


def test_hash_values_are_pinned_so_router_and_engine_of_any_version_agree():
    assert hash_blocks(list(range(32)), 16) == [15419130808853295947, 13931401434043050494]
    assert hash_blocks(list(range(32)), 16, "tenant-a") == [965739353149329595, 14769859723422569984]


@given(tokens, st.integers(1, 16))
def test_only_full_blocks_are_hashed(ids, block_size):
    assert len(hash_blocks(ids, block_size)) == len(ids) // block_size


@given(tokens, st.integers(1, 16), st.integers(0, 99))
def test_changing_a_token_changes_its_block_hash_and_every_later_one_only(ids, block_size, at):
    hashes = hash_blocks(ids, block_size)
    if at >= len(hashes) * block_size:
        return
    changed = ids[:at] + [ids[at] + 1] + ids[at + 1:]
    other = hash_blocks(changed, block_size)
    first = at // block_size
    assert other[:first] == hashes[:first]
    assert all(a != b for a, b in zip(other[first:], hashes[first:]))


@given(tokens, st.integers(1, 16))
def test_a_salt_changes_every_block_hash(ids, block_size):
    plain, salted, other = (hash_blocks(ids, block_size, s) for s in (None, "t1", "t2"))
    assert all(len({a, b, c}) == 3 for a, b, c in zip(plain, salted, other))


@given(tokens, st.integers(1, 16), st.integers(0, 100))
def test_extending_from_known_parents_equals_hashing_from_scratch(ids, block_size, cut):
    head = hash_blocks(ids[:cut], block_size, "s")
    assert hash_blocks(ids, block_size, "s", head) == hash_blocks(ids, block_size, "s")
