"""Every error the V3 artifact stack raises on purpose, one type per failure (docs/artifact-v3.md, error table).

Invariant: every type derives from :class:`ArtifactError` (itself a :class:`ninfer.errors.NInferError`),
and every message names the file, object, binding or component at fault, so a bad artifact is
always a clear error and never garbage output. Callers catch a family (``DirectoryError``,
``BindingError``...) or the exact type; tests assert the exact type.
"""

from __future__ import annotations

from ninfer.errors import NInferError, NotSupportedError


class ArtifactError(NInferError):
    """Base of every artifact error."""


class ArtifactNotFoundError(ArtifactError):
    """The entry file does not exist (or is not a regular file)."""


class ReaderClosedError(ArtifactError):
    """A read was attempted on a closed :class:`~ninfer.artifact.reader.ArtifactReader`."""


# -- framing: headers, magics, file lengths ------------------------------------------------------
class FramingError(ArtifactError):
    """A file's header, padding or length breaks the V3 framing."""


class FileLengthError(FramingError):
    """A file is not exactly as long as its header and the file table say."""


class TruncatedFileError(FileLengthError):
    """A file ends before the bytes its header and the file table promise."""


class BadMagicError(FramingError):
    """A file does not start with the entry (``NINFER\\0``) or part (``NINPRT\\0``) magic."""


class UnsupportedVersionError(FramingError):
    """The magic is right but the container version is not 3."""


# -- the JSON directory --------------------------------------------------------------------------
class DirectoryError(ArtifactError):
    """The root JSON directory breaks the schema."""


class MalformedJSONError(DirectoryError):
    """The directory bytes are not UTF-8 JSON (or use NaN/Infinity)."""


class DuplicateMemberError(DirectoryError):
    """A JSON object repeats a member name."""


class UnknownFieldError(DirectoryError):
    """A closed record carries a field the schema does not define."""


class SchemaError(DirectoryError):
    """A field is missing, has the wrong type, or holds a value outside its domain."""


class DuplicateIdError(DirectoryError):
    """Two objects share an id (tensors and resources share one namespace)."""


class ObjectRangeError(DirectoryError):
    """Objects are out of offset order or reach past the logical payload."""


class OverlappingObjectsError(ObjectRangeError):
    """Two objects' byte ranges intersect."""


class MisalignedObjectError(ObjectRangeError):
    """A tensor object's offset is not a multiple of 256."""


class ObjectSizeError(DirectoryError):
    """An object's ``bytes`` differs from the encoded size of its (format, layout, shape)."""


class UnknownReferenceError(DirectoryError):
    """A binding, use, resource role or component target names something that does not exist."""


class PartRangeError(DirectoryError):
    """A binding Part's element range is empty or reaches past its object's elements."""


# -- reading the payload -------------------------------------------------------------------------
class PartFileError(ArtifactError):
    """A continuation part cannot serve the read."""


class MissingPartError(PartFileError):
    """A continuation part named in the file table does not exist."""


class ArtifactIdMismatchError(PartFileError):
    """A part carries another artifact's id (or another index): it belongs to a different file set."""


class ChecksumMismatchError(ArtifactError):
    """An object's bytes do not hash to the checksum its record states."""


# -- formats -------------------------------------------------------------------------------------
class FormatError(ArtifactError):
    """An object's format or layout cannot be interpreted (raised when the object is interpreted)."""


class UnknownFormatError(FormatError):
    """The format name is not in the V3 format table."""


class UnknownLayoutError(FormatError):
    """The layout name is unknown, or not defined for the object's format."""


class UnsupportedFormatError(FormatError, NotSupportedError):
    """A V3 format this engine knows but cannot load yet (the quantized formats)."""


# -- binding, planning, materializing ------------------------------------------------------------
class MissingComponentError(ArtifactError):
    """A selected component (or a spec's component) is not declared in the artifact."""


class BindingError(ArtifactError):
    """A logical parameter cannot be bound to the artifact's objects."""


class MissingBindingError(BindingError):
    """A required parameter has no binding."""


class CoverageError(BindingError):
    """A binding's parts cover a different number of elements than the parameter has."""


class BindingShapeError(BindingError):
    """A whole-object binding's object shape differs from the parameter's shape."""


class PlacementError(ArtifactError):
    """A load plan names a device the loader cannot place weights on, or belongs to another artifact."""


# -- writing -------------------------------------------------------------------------------------
class WriterError(ArtifactError):
    """The writer was used against its protocol (phase, order, sizes) or could not publish."""


class TargetExistsError(WriterError):
    """A file the writer would publish already exists; the writer never overwrites."""
