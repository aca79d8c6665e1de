"""OpenAPI schema generation (drf-spectacular) with component names that cannot collide."""
from __future__ import annotations

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema


class AutoSchema(SpectacularAutoSchema):
    def get_serializer_name(self, serializer, direction) -> str:
        """Views keep their input as a nested `InputSerializer`; named by class alone, every one
        of them would be the component "Input" and overwrite the others in the schema. A nested
        serializer is named after its view instead: `RunListApi.InputSerializer` -> `RunListInput`."""
        cls = type(serializer)
        outer, _, inner = cls.__qualname__.rpartition(".")
        if not outer or "<" in outer:
            return cls.__name__
        return outer.removeprefix("_").removesuffix("Api") + inner
