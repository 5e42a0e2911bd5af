"""The arguments of zero.parallel's plans and splitters, checked by name
before any module is touched: a wrong model or mesh failed deep inside
with a bare AttributeError ('Sequential' object has no attribute 'cfg',
'NoneType' object has no attribute 'size'), a mesh of two dimensions
with torch's placement errors."""
from __future__ import annotations

from zero.config._values import require_bool


def check_line(mesh, name: str, dim: str):
    """mesh: one dimension of a DeviceMesh (mesh["tp"] or mesh["pp"]), or
    what answers as one (its size())."""
    if not callable(getattr(mesh, "size", None)):
        raise TypeError(f"{name} must be a DeviceMesh of one dimension (mesh[{dim!r}]), got "
                        f"{type(mesh).__name__}")
    if getattr(mesh, "ndim", 1) != 1:
        raise ValueError(f"{name} has {mesh.ndim} dimensions "
                         f"({', '.join(mesh.mesh_dim_names or ())}); pass its {dim!r} "
                         f"dimension, mesh[{dim!r}]")


def check_model(model, needs: tuple, what: str, call: str):
    """model has the attributes `needs` (dotted): the model `call` plans."""
    for path in needs:
        at = model
        for part in path.split("."):
            at = getattr(at, part, None)
        if at is None:
            raise TypeError(f"{call} takes {what}; {type(model).__name__} has no {path!r}")


def check_flags(**flags):
    for name, value in flags.items():
        require_bool(value, name)
