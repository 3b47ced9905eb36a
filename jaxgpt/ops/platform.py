"""Which backend a traced program is for: the one question every platform-specific path in `jaxgpt.ops` asks."""

from __future__ import annotations

import jax


def current_platform() -> str:
    """The platform a traced program is for: the mesh's (`jax.set_mesh`, also a TPU topology's abstract
    devices when compiling ahead of time), else the default backend's."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return device.platform if device is not None else jax.default_backend()
