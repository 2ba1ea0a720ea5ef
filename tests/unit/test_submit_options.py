"""`SubmitOptions` (the typed keyword arguments of both clients' `submit`) lists exactly what
`build_request` takes: its request arguments and `SamplingParams`' fields."""

from __future__ import annotations

import inspect

from producer_sdk._core import build_request
from producer_sdk.client import Handle
from producer_sdk.protocol import SAMPLING_FIELDS
from producer_sdk.submit_options import GenerateOptions, SubmitOptions, WaitOptions, split_wait
from producer_sdk.sync import SyncHandle


def test_submit_options_name_what_a_request_is_built_from():
    params = inspect.signature(build_request).parameters
    request_args = {n for n, p in params.items() if p.kind is p.KEYWORD_ONLY} - {"limits", "propagate_trace"}
    assert set(SubmitOptions.__annotations__) == request_args | set(SAMPLING_FIELDS)


def test_generate_options_are_submit_and_wait_options():
    assert set(GenerateOptions.__annotations__) == set(SubmitOptions.__annotations__) | set(WaitOptions.__annotations__)
    for handle in (Handle, SyncHandle):  # what a handle's wait takes
        assert set(WaitOptions.__annotations__) == set(inspect.signature(handle.result).parameters) - {"self"}


def test_split_wait_takes_only_the_waiting_options():
    options = {"max_tokens": 3, "timeout": 2.0, "partial_ok": True}
    assert split_wait(options) == {"timeout": 2.0, "partial_ok": True}
    assert options == {"max_tokens": 3}
