"""Every nnet3 component type, one module per family; importing this package
registers them all in ``base.COMPONENT_TYPES`` (keyed by Kaldi type name)."""

import importlib
import pkgutil

from engine.nnet.components.base import (  # noqa: F401
    COMPONENT_TYPES,
    Component,
    ComponentPrecomputedIndexes,
    ComponentProperty,
    MiscComputationInfo,
    UpdatableComponent,
    component_class,
    new_component_from_config,
    read_component,
    register_component,
)

# Each family module registers its classes with @register_component on import.
for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base",) and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")
