"""Reading a request trace in Mooncake's format (FAST'25): one JSON object per line.

Each line is one request, e.g. ``{"timestamp": 0, "input_length": 6758, "output_length": 500,
"hash_ids": [0, 1, 2]}``: its arrival time, its prompt length in tokens, its output length,
and the ids of its 512-token prefix blocks (equal ids, equal blocks).  Other fields are
ignored.  A file that is not such a trace (not found, a directory, binary, not JSON, a line
missing a field or holding the wrong type, no request at all) raises ``TraceFileError`` with
one line naming the file, the line and what is wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec

from kvring.common.errors import KVRingError

EXAMPLE = '{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}'
_FORMAT = f"a trace holds one JSON object per line (Mooncake's format), e.g. {EXAMPLE}"

NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class TraceFileError(KVRingError):
    """The file is not a request trace kvring can replay (the message says where and why)."""


class TraceRequest(msgspec.Struct, frozen=True):
    """One request of the trace."""

    timestamp: float
    input_length: NonNegative
    hash_ids: list[NonNegative]
    output_length: NonNegative = 0


_decoder = msgspec.json.Decoder(TraceRequest)


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's requests in timestamp order (stable), the first ``limit`` of them."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise TraceFileError(f"{path} is a directory, not a trace file: {_FORMAT}") from None
    except OSError as exc:
        raise TraceFileError(f"cannot read {path}: {exc.strerror or exc}") from None
    if b"\0" in raw[:65536]:
        raise TraceFileError(f"{path} is a binary file, not a trace: {_FORMAT}")
    requests = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(_decoder.decode(line))
        except msgspec.ValidationError as exc:
            raise TraceFileError(f"{path}, line {number}: {exc}; {_FORMAT}") from None
        except msgspec.DecodeError as exc:
            raise TraceFileError(f"{path}, line {number} is not a JSON object ({exc}); {_FORMAT}") from None
    if not requests:
        raise TraceFileError(f"{path} holds no requests: {_FORMAT}")
    requests.sort(key=lambda r: r.timestamp)
    return requests[:limit] if limit is not None else requests
