"""``compat``'s rank-order guard for ``new_group``: torch with ``sort_ranks`` is asked to keep the
order; an older torch (found on a GPU machine with torch 2.11: ``new_group() got an unexpected
keyword argument 'sort_ranks'``) gets no such argument, and a permuted rank list is refused."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_mmpar.compat import _keep_rank_order


def new_group_with_sort_ranks(ranks: Any = None, sort_ranks: bool = True) -> None: ...


def new_group_before_2_12(ranks: Any = None, timeout: Any = None) -> None: ...


def test_sort_ranks_is_passed_where_new_group_takes_it() -> None:
    kwargs: dict[str, Any] = {}
    _keep_rank_order(new_group_with_sort_ranks, ([3, 1],), kwargs)
    assert kwargs == {"sort_ranks": False}


def test_older_torch_gets_no_sort_ranks_and_ascending_groups_pass() -> None:
    kwargs: dict[str, Any] = {"ranks": [0, 2]}
    _keep_rank_order(new_group_before_2_12, (), kwargs)
    assert kwargs == {"ranks": [0, 2]}
    _keep_rank_order(new_group_before_2_12, ([1, 3],), {})


def test_older_torch_refuses_a_permuted_group() -> None:
    with pytest.raises(RuntimeError, match=r"ranks \[3, 1\] \(not in ascending order\)"):
        _keep_rank_order(new_group_before_2_12, ([3, 1],), {})
