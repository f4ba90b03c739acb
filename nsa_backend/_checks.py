"""Host-side validation shared by every public op.

Every public op validates its inputs here before any kernel launches, so a bad call fails with a
``TypeError`` (wrong Python or tensor type, wrong dtype) or ``ValueError`` (wrong rank, shape,
device, layout or value) that names the argument, what was expected and what was received.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

FP8 = torch.float8_e4m3fn

# A shape entry is an int (must match), None (any size) or a str naming a symbolic dimension that
# must agree across all tensors checked with the same ``dims`` dictionary.
ShapeSpec = Sequence[int | str | None]


def _fmt_dtypes(dtypes: Iterable[torch.dtype]) -> str:
    names = [str(d).replace("torch.", "") for d in dtypes]
    return names[0] if len(names) == 1 else "one of " + ", ".join(names)


def check_tensor(
    x: object,
    name: str,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    shape: ShapeSpec | None = None,
    dims: dict[str, int] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument and return it.

    Parameters
    ----------
    x : object
        The value passed by the caller.
    name : str
        The argument name used in error messages.
    dtype : torch.dtype or sequence of torch.dtype, optional
        Accepted dtypes.
    ndim : int or sequence of int, optional
        Accepted ranks.
    shape : sequence of (int | str | None), optional
        Expected shape; strings are symbolic dimensions bound in ``dims``.
    dims : dict, optional
        Symbol table shared across calls; a symbol seen for the first time is bound.
    device : torch.device, optional
        Required device (type and index).
    contiguous : bool
        Require ``x.is_contiguous()``.
    last_dim_contiguous : bool
        Require ``x.stride(-1) == 1``.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if dtype is not None and x.dtype is not dtype:  # dtypes are singletons: the common case is one identity test
        accepted = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if x.dtype not in accepted:
            raise TypeError(f"{name}: expected dtype {_fmt_dtypes(accepted)}, got {_fmt_dtypes([x.dtype])}")
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.dim() not in ranks:
            want = " or ".join(f"{r}-D" for r in ranks)
            raise ValueError(f"{name}: expected a {want} tensor, got shape {tuple(x.shape)}")
    if shape is not None:
        if x.dim() != len(shape):
            raise ValueError(f"{name}: expected a {len(shape)}-D tensor of shape {_fmt_shape(shape, dims)}, "
                             f"got shape {tuple(x.shape)}")
        for axis, (want, got) in enumerate(zip(shape, x.shape)):
            if want is None:
                continue
            if isinstance(want, str):
                if dims is None:
                    raise AssertionError("symbolic shape needs a dims table")
                bound = dims.setdefault(want, int(got))
                if bound != got:
                    raise ValueError(f"{name}: expected shape {_fmt_shape(shape, dims)} ({want}={bound} from an "
                                     f"earlier argument), got {tuple(x.shape)} (dim {axis} is {got})")
            elif want != got:
                raise ValueError(f"{name}: expected shape {_fmt_shape(shape, dims)}, got {tuple(x.shape)}")
    if device is not None:
        here = x.device
        if here != device and not _same_device(here, device):  # equal devices (the common case) compare in C
            raise ValueError(f"{name}: expected a tensor on {device}, got one on {here}")
    if contiguous and not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {tuple(x.stride())} "
                         f"for shape {tuple(x.shape)}")
    if last_dim_contiguous and x.dim() > 0 and x.size(-1) > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name}: expected the last dimension to be contiguous (stride 1), "
                         f"got strides {tuple(x.stride())}")
    return x


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type == "cpu" or a.index is None or b.index is None:
        return True
    return a.index == b.index


def _fmt_shape(shape: ShapeSpec, dims: dict[str, int] | None) -> str:
    parts = []
    for s in shape:
        if s is None:
            parts.append("*")
        elif isinstance(s, str) and dims is not None and s in dims:
            parts.append(f"{s}={dims[s]}")
        else:
            parts.append(str(s))
    return "[" + ", ".join(parts) + "]"


def check_int(value: object, name: str, *, min_value: int | None = None, max_value: int | None = None,
              choices: Iterable[int] | None = None) -> int:
    """Validate a Python int argument (bools are rejected) and return it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} ({value!r})")
    if choices is not None:
        allowed = sorted(set(choices))
        if value not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {value}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name}: expected an int >= {min_value}, got {value}")
    if max_value is not None and value > max_value:
        raise ValueError(f"{name}: expected an int <= {max_value}, got {value}")
    return value


def check_float(value: object, name: str, *, positive: bool = False) -> float:
    """Validate a finite Python float (ints accepted) and return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__} ({value!r})")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}: expected a finite float, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name}: expected a float > 0, got {value}")
    return value


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} ({value!r})")
    return value


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, one of {list(choices)}, got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name}: expected one of {list(choices)}, got {value!r}")
    return value
