"""The sampling fields a request may leave unset, read from the proto (`optional` numeric
fields of `meshserve.v1.SamplingParams`): the gateway forwards those its client set, the
worker gives the unset ones the model's or the engine's defaults. Adding such a field to
the proto adds it to both."""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from meshserve.v1 import common_pb2

OPTIONAL_SAMPLING_FIELDS: tuple[str, ...] = tuple(
    field.name
    for field in common_pb2.SamplingParams.DESCRIPTOR.fields
    if field.has_presence and field.type != FieldDescriptor.TYPE_STRING
)
