"""What identifies a value or a function: tokens that are equal exactly when the
computation is the same, in this run and the next."""

from __future__ import annotations

import numpy as np
import pytest

from tierflow.storage import identity


def test_keys_of_functions_and_objects() -> None:
    def fact(n: int) -> int:
        return 1 if n <= 1 else n * fact(n - 1)

    assert identity.function_token(fact) == identity.function_token(fact)  # recursion terminates
    rng_a = np.random.default_rng(1)
    rng_b = np.random.default_rng(2)
    assert identity.token(rng_a) != identity.token(rng_b), "objects by state, not by repr"
    assert identity.token({"b", "a"}) == identity.token({"a", "b"})
    lock = __import__("threading").Lock()
    assert identity.token(lock) != identity.token(__import__("threading").Lock()), "by identity"
    assert identity.token(lock, loose=True) == identity.token(
        __import__("threading").Lock(), loose=True
    ), "in globals: by type"


@pytest.mark.torch
def test_torch_weights_are_part_of_a_key() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 2)
    b = torch.nn.Linear(4, 2)
    assert identity.token(a) != identity.token(b)
    b.load_state_dict(a.state_dict())
    assert identity.token(a) == identity.token(b), "the same weights in another object"
    assert identity.token(torch.arange(4.0)) == identity.token(torch.arange(4.0).clone())
