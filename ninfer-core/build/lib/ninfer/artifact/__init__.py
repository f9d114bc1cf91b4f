"""The V3 ``.ninfer`` artifact: framing, reader, binder, load plan and materializer (docs/artifact-v3.md).

Loading is three stages, each checking the contract it consumes::

    reader = ArtifactReader.open(path)          # framing + directory (entry file only)
    bound = bind(reader, specs)                 # logical parameters -> parent element ranges
    plan = resolve_load(bound, "cuda:0")        # explicit placement, bytes per device
    weights = Materializer(reader).materialize(plan)

or ``load_weights(reader, specs, device)`` for all three. The writer lives in
``ninfer.artifact.writer``; every error is an :class:`ArtifactError` subclass from
:mod:`ninfer.artifact.errors`.
"""

from ninfer.artifact.binder import BoundParameter, BoundPiece, BoundWeights, bind
from ninfer.artifact.directory import (
    BindingRecord,
    ComponentRecord,
    Directory,
    FileRecord,
    ObjectRecord,
    PartRecord,
    UseRecord,
    parse_directory,
)
from ninfer.artifact.errors import (
    ArtifactError,
    ArtifactIdMismatchError,
    ArtifactNotFoundError,
    BadMagicError,
    BindingError,
    BindingShapeError,
    ChecksumMismatchError,
    CoverageError,
    DirectoryError,
    DuplicateIdError,
    DuplicateMemberError,
    FileLengthError,
    FormatError,
    FramingError,
    MalformedJSONError,
    MisalignedObjectError,
    MissingBindingError,
    MissingComponentError,
    MissingPartError,
    ObjectRangeError,
    ObjectSizeError,
    OverlappingObjectsError,
    PartFileError,
    PartRangeError,
    PlacementError,
    ReaderClosedError,
    SchemaError,
    TargetExistsError,
    TruncatedFileError,
    UnknownFieldError,
    UnknownFormatError,
    UnknownLayoutError,
    UnknownReferenceError,
    UnsupportedFormatError,
    UnsupportedVersionError,
    WriterError,
)
from ninfer.artifact.format import FORMATS, SUPPORTED_FORMATS, FormatInfo
from ninfer.artifact.info import describe, summarize
from ninfer.artifact.load_plan import LoadPlan, ParameterLoad, ParentLoad, resolve_load
from ninfer.artifact.materializer import Materializer, load_weights
from ninfer.artifact.reader import ArtifactReader

__all__ = [
    "ArtifactReader", "bind", "resolve_load", "Materializer", "load_weights", "describe", "summarize",
    "BoundParameter", "BoundPiece", "BoundWeights", "LoadPlan", "ParameterLoad", "ParentLoad",
    "Directory", "ComponentRecord", "ObjectRecord", "BindingRecord", "PartRecord", "UseRecord", "FileRecord",
    "parse_directory", "FORMATS", "SUPPORTED_FORMATS", "FormatInfo",
    "ArtifactError", "ArtifactIdMismatchError", "ArtifactNotFoundError", "BadMagicError", "BindingError",
    "BindingShapeError", "ChecksumMismatchError", "CoverageError", "DirectoryError", "DuplicateIdError",
    "DuplicateMemberError", "FileLengthError", "FormatError", "FramingError", "MalformedJSONError",
    "MisalignedObjectError", "MissingBindingError", "MissingComponentError", "MissingPartError",
    "ObjectRangeError", "ObjectSizeError", "OverlappingObjectsError", "PartFileError", "PartRangeError",
    "PlacementError", "ReaderClosedError", "SchemaError", "TargetExistsError", "TruncatedFileError",
    "UnknownFieldError", "UnknownFormatError", "UnknownLayoutError", "UnknownReferenceError",
    "UnsupportedFormatError", "UnsupportedVersionError", "WriterError",
]
