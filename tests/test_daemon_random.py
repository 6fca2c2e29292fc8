"""Randomized record histories through the daemon's State against a hand-kept reference
(``daemon_random.py``; ``python tests/daemon_random.py 2000`` runs more)."""

import pytest
from daemon_random import run


@pytest.mark.parametrize("block", range(4))
def test_random_histories_keep_the_invariants(block):
    for seed in range(block * 10, block * 10 + 10):
        run(seed)
