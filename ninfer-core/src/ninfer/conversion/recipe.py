"""Quantization recipes: which stored format each object of a conversion takes (docs/converter.md).

A recipe is an ordered list of ``(pattern, format)`` rules over logical parameter names (``fnmatch`` globs,
``*`` crosses ``/``); the first rule matching a parameter decides, and ``keep`` keeps the source's storage
format. A named preset (:data:`PRESETS`) or a TOML file (``[formats]`` table of pattern = format, optional
``base = "<preset>"`` whose rules follow the file's) gives one. ``method`` is the encoder of the groupwise
formats and nvfp4: ``rtn`` (round to nearest, the default) or ``search`` (per-group scale search,
:mod:`ninfer.quant.groupwise`; per-block scale search, :mod:`ninfer.quant.nvfp4`); a preset name with ``+search``
(``q4+search``) or ``method = "search"`` in a TOML file selects it. fp8 is always round to nearest. ``activations``: ``a16`` (default) or ``a8`` (a preset
name with ``+a8`` last, or ``activations = "a8"`` in a TOML file): the Uses of parameters stored as fp8 row
objects are recorded ``AllowA8`` instead of ``A16Only``, so the ops that have an A8 product run them with 8-bit
activations.

Invariants of :func:`assign`:

- only matmul weights are quantized: a parameter of rank >= 2 all of whose uses carry an activation
  permission, on an object that no other kind of parameter shares (an embedding table, a norm, a tied
  embedding/head stays as stored); a preset passes over the others, an explicit TOML rule naming one is a
  :class:`RecipeError`;
- every parameter bound to one object gets the same format (objects are the unit of storage), else a
  :class:`RecipeError` naming the object and both parameters;
- a TOML pattern that matches no parameter is a :class:`RecipeError` naming it;
- ``nvfp4`` goes only to objects its layout can hold (``N % 128 == 0``, ``K % 64 == 0``, and every parameter
  bound to the object a block of whole 128-row tiles): a preset keeps the others as stored, an explicit TOML rule
  selecting one is a :class:`RecipeError` naming the constraint.
"""

from __future__ import annotations

import fnmatch
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ninfer.artifact.format import FORMATS
from ninfer.artifact.source_mapping import ConversionPlan
from ninfer.conversion.errors import ConversionError
from ninfer.quant import QUANTIZED_FORMATS, nvfp4

KEEP = "keep"
METHODS = ("rtn", "search")
ACTIVATIONS = ("a16", "a8")


class RecipeError(ConversionError):
    """A recipe that names no parameter, an unknown format, or formats an object cannot take."""


@dataclass(frozen=True)
class Recipe:
    """Ordered ``rules`` (pattern, format). The first ``explicit`` rules are a TOML file's own (the rest come
    from its base preset): each must match a parameter, and only matmul weights."""

    name: str
    rules: tuple[tuple[str, str], ...]
    explicit: int = 0
    method: str = "rtn"
    activations: str = "a16"  # "a8": the uses of fp8 weights are recorded AllowA8 (A8 at run time)


_UNIFORM = {"fp8": "fp8_e4m3fn_row_bf16", "q8": "q8_g32_fp16", "q6": "q6_g64_fp16", "q5": "q5_g64_fp16",
            "q4": "q4_g64_fp16", "nvfp4": "nvfp4"}
PRESETS: Mapping[str, Recipe] = {
    **{name: Recipe(name, (("*", fmt),)) for name, fmt in _UNIFORM.items()},
    # experts q4, the LM head q6, routers and the shared-expert gate as stored, every other matmul weight q8
    "mixed": Recipe("mixed", (("*/router", KEEP), ("*/shared/gate", KEEP), ("*/experts/*", "q4_g64_fp16"),
                              ("*/lm_head", "q6_g64_fp16"), ("*", "q8_g32_fp16"))),
}


def _check_format(fmt: str, where: str) -> str:
    if fmt != KEEP and fmt not in QUANTIZED_FORMATS:
        known = ", ".join((*QUANTIZED_FORMATS, KEEP))
        what = "a raw format; use keep" if fmt in FORMATS else "unknown"
        raise RecipeError(f"{where}: format {fmt!r} is {what} (recipe formats: {known})")
    return fmt


def load_recipe(spec: str) -> Recipe:
    """A preset by name (``+search`` appended: the scale-search encoder; ``+a8`` appended last: 8-bit
    activations for the fp8 dense projections), or a TOML recipe file by path."""
    if spec.endswith("+a8") and spec != "+a8":
        return replace(load_recipe(spec[:-len("+a8")]), name=spec, activations="a8")
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.endswith("+search") and spec[:-len("+search")] in PRESETS:
        return replace(PRESETS[spec[:-len("+search")]], name=spec, method="search")
    path = Path(spec)
    if not path.is_file():
        raise RecipeError(f"--quantize {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a TOML file")
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RecipeError(f"recipe {str(path)!r} is not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - {"base", "formats", "method", "activations"})
    if unknown:
        raise RecipeError(f"recipe {str(path)!r}: unknown key {unknown[0]!r} "
                          f"(allowed: base, formats, method, activations)")
    activations = doc.get("activations", "a16")
    if activations not in ACTIVATIONS:
        raise RecipeError(f"recipe {str(path)!r}: activations {activations!r} is not one of "
                          f"{', '.join(ACTIVATIONS)}")
    method = doc.get("method", "rtn")
    if method not in METHODS:
        raise RecipeError(f"recipe {str(path)!r}: method {method!r} is not one of {', '.join(METHODS)}")
    formats = doc.get("formats", {})
    if not isinstance(formats, dict) or not all(isinstance(v, str) for v in formats.values()):
        raise RecipeError(f"recipe {str(path)!r}: [formats] must map parameter patterns to format names")
    rules = tuple((pat, _check_format(fmt, f"recipe {str(path)!r}, pattern {pat!r}"))
                  for pat, fmt in formats.items())
    own = len(rules)
    base = doc.get("base")
    if base is not None:
        if base not in PRESETS:
            raise RecipeError(f"recipe {str(path)!r}: base {base!r} is not a preset ({', '.join(PRESETS)})")
        rules += PRESETS[base].rules
    return Recipe(path.name, rules, explicit=own, method=method, activations=activations)


def assign(recipe: Recipe, plan: ConversionPlan, shapes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """``{object id: quantized format}`` for the objects ``recipe`` quantizes (see the module invariants);
    ``shapes`` are the objects' stored shapes."""
    policies: dict[str, list] = {}
    for u in plan.uses:
        policies.setdefault(u.parameter, []).append(u.activation_policy)
    holders: dict[str, list[str]] = {}
    for b in plan.bindings:
        for oid in ((b.object,) if b.object is not None else tuple(p.object for p in b.parts)):
            holders.setdefault(oid, []).append(b.name)

    def matmul(name: str, oid: str) -> bool:
        pol = policies.get(name)
        return bool(pol) and all(p is not None for p in pol) and len(shapes[oid]) >= 2

    ranges: dict[str, list[tuple[int, int]]] = {}
    for b in plan.bindings:
        for p in b.parts:
            ranges.setdefault(p.object, []).append((p.begin, p.end))

    def tiled(oid: str) -> bool:
        """Whether nvfp4's layout holds object ``oid`` and every part of it a binding takes."""
        shape = tuple(shapes[oid])
        if not nvfp4.fits(shape):
            return False
        tile = nvfp4.LAYOUT_ROWS * shape[-1]
        return all(b % tile == 0 and e % tile == 0 for b, e in ranges.get(oid, ()))

    used: set[int] = set()
    out: dict[str, str] = {}
    untiled: list[str] = []   # objects a preset's nvfp4 rule selected but nvfp4's layout cannot hold
    for oid, names in holders.items():
        chosen: tuple[str, str] | None = None
        for name in names:
            rule, fmt = -1, KEEP
            for i, (pattern, f) in enumerate(recipe.rules):
                if fnmatch.fnmatchcase(name, pattern):
                    rule, fmt = i, f
                    used.add(i)
                    break
            if fmt != KEEP and not all(matmul(n, oid) for n in names):
                if rule < recipe.explicit:
                    pattern = recipe.rules[rule][0]
                    raise RecipeError(f"recipe {recipe.name!r}: pattern {pattern!r} selects {name!r} (object {oid!r}), "
                                      f"which is not a matmul weight, or shares its object with a parameter that is "
                                      f"not (e.g. a head tied to the embedding); it stays as stored")
                fmt = KEEP
            if fmt == nvfp4.FORMAT and not tiled(oid):
                if rule < recipe.explicit:
                    raise RecipeError(
                        f"recipe {recipe.name!r}: pattern {recipe.rules[rule][0]!r} selects {name!r} (object {oid!r}, "
                        f"shape {list(shapes[oid])}), which {nvfp4.FORMAT} cannot hold: it needs N % "
                        f"{nvfp4.LAYOUT_ROWS} == 0, K % {nvfp4.LAYOUT_K} == 0 and parameters of whole "
                        f"{nvfp4.LAYOUT_ROWS}-row blocks")
                untiled.append(oid)
                fmt = KEEP
            if chosen is not None and chosen[1] != fmt:
                raise RecipeError(f"recipe {recipe.name!r}: object {oid!r} holds {chosen[0]!r} ({chosen[1]}) and "
                                  f"{name!r} ({fmt}); parameters stored in one object take one format")
            chosen = (name, fmt)
        if chosen is not None and chosen[1] != KEEP:
            out[oid] = chosen[1]
    stray = [recipe.rules[i][0] for i in range(recipe.explicit) if i not in used]
    if stray:
        raise RecipeError(f"recipe {recipe.name!r}: pattern {stray[0]!r} matches no parameter of this model")
    if not out:
        # Asked to quantize and nothing would be: a silent full-precision artifact is never what was meant.
        why = ("the source mapping declares no weight uses (UsePlan), so no parameter is known to be a matmul "
               "weight" if not plan.uses else
               f"{nvfp4.FORMAT} cannot hold any of the matmul weights it selects (e.g. {untiled[0]!r}, shape "
               f"{list(shapes[untiled[0]])}: it needs N % {nvfp4.LAYOUT_ROWS} == 0 and K % {nvfp4.LAYOUT_K} == 0)"
               if untiled else "no matmul weight of this model matches its rules")
        raise RecipeError(f"recipe {recipe.name!r} quantizes nothing: {why}")
    return out
