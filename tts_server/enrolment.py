"""A clip enrolled for a request (an upload, a synthesis body's inline reference): `qwen_tts.voices.enroll_clip`'s
refusals as 422s naming the request's own fields."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from qwen_tts.icl_profile import IclDataError
from qwen_tts.voices import ClipRefused

from .errors import InvalidField
from .runtime import ReferenceEncoderUnavailable


@contextlib.contextmanager
def enrolment_refusals(audio: str, text: str, unavailable: str, hint: str = "") -> Iterator[None]:
    """Around `enroll_clip` for a request whose clip is the field `audio` and its transcript `text`; where this
    server computes no ICL reference codes, the error names `unavailable` and ends with `hint`."""
    try:
        yield
    except ClipRefused as e:
        raise InvalidField(str(e), param=audio, code="invalid_audio") from None
    except IclDataError as e:
        raise InvalidField(f"{text}: {e}", param=text) from None
    except ReferenceEncoderUnavailable as e:
        raise InvalidField(
            f"{unavailable}: this server cannot compute ICL reference codes ({e}){hint}",
            param=unavailable,
            code="icl_unavailable",
        ) from None
