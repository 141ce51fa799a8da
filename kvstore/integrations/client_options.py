"""The client options an engine's connector takes from its config, checked when the engine starts: a bad one
would otherwise surface at the first load or save, as a failed transfer the engine recomputes past."""

from __future__ import annotations

import math


def check_client_options(
    who: str, *, target: str, timeout: float | None, retries: int | None, lane: str, codec: str
) -> None:
    from kvstore.addresses import check_target
    from kvstore.codecs import CodecError, get_codec
    from kvstore.lanes.client.negotiate import MODES

    try:
        check_target(target)
    except ValueError as err:
        raise ValueError(f"{who}: {err}") from None
    if timeout is not None and not 0 < timeout < math.inf:
        raise ValueError(f"{who}: timeout must be seconds above 0, not {timeout!r}")
    if retries is not None and retries < 0:
        raise ValueError(f"{who}: retries must be >= 0, not {retries!r}")
    if lane not in MODES:
        raise ValueError(f"{who}: lane must be one of {', '.join(MODES)}, not {lane!r}")
    if codec != "auto":
        try:
            get_codec(codec)
        except CodecError as err:
            raise ValueError(f"{who}: codec: auto or {err}") from None
