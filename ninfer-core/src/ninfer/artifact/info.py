"""What ``ninfer info`` shows about an artifact: :func:`summarize` (JSON-ready) and :func:`describe` (text).

Reads only the directory (no payload, no part file is opened). Object ownership is derived, since
objects carry no component: an object belongs to every component that references it, through a
resource role or through a binding (or use auxiliary) whose name starts with ``<component>/``;
``proposal/...`` parameters belong to ``text``. Objects nothing references are listed as
``(unreferenced)``. Parameter classes are binding names with every layer index replaced by ``*``; each class
lists the stored formats of its parameters (what a quantization recipe chose). The config summary comes from the architecture plugin's
``summarize_config`` when one is installed, otherwise from a fixed list of raw config keys.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any

RAW_CONFIG_KEYS: tuple[str, ...] = (
    "model_type", "hidden_size", "num_hidden_layers", "intermediate_size", "moe_intermediate_size",
    "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "num_experts", "num_experts_per_tok", "vocab_size",
    "max_position_embeddings", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
)
UNREFERENCED = "(unreferenced)"


def _owner(name: str, components) -> str:
    head = name.split("/", 1)[0]
    if head in components:
        return head
    return "text" if head == "proposal" else f"({head})"


def _owners(directory) -> dict[str, set[str]]:
    owners: dict[str, set[str]] = {o.id: set() for o in directory.objects}
    for cid, comp in directory.components.items():
        for oid in comp.resources.values():
            owners[oid].add(cid)
    for name, binding in directory.bindings.items():
        for oid in binding.object_ids():
            owners[oid].add(_owner(name, directory.components))
    for use in directory.uses:
        for aux in use.auxiliaries.values():
            for oid in aux.object_ids():
                owners[oid].add(_owner(use.parameter, directory.components))
    return owners


def _config_summary(config: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(source, fields): the plugin's summary, or raw key fields when no plugin provides it."""
    arch = config["architectures"][0]
    note = "raw config"
    try:
        from ninfer.plugins import PluginError, get_registry

        try:
            spec = get_registry().architectures.get(arch)
        except PluginError as exc:  # info must still describe the file when a plugin is broken
            spec, note = None, f"raw config; plugin registry failed: {exc}"
        if spec is not None:
            return f"plugin architecture {arch}", dict(spec.summarize_config(config))
    except ImportError:
        pass
    fields = {k: config[k] for k in RAW_CONFIG_KEYS if k in config}
    if isinstance(config.get("layer_types"), list):
        fields["layer_types"] = dict(Counter(map(str, config["layer_types"])))
    return note, fields


def summarize(reader) -> dict[str, Any]:
    """A JSON-serializable description of the artifact (the ``--json`` output of ``ninfer info``)."""
    d = reader.directory
    owners = _owners(d)
    files = [{"index": f.index, "path": str(p), "payload_bytes": f.payload_bytes, "present": os.path.exists(p)}
             for f, p in zip(d.files, reader.files, strict=False)]
    components = []
    for cid, comp in d.components.items():
        source, fields = _config_summary(comp.config)
        components.append({
            "id": cid, "architectures": list(comp.config["architectures"]), "target": comp.target,
            "config_summary_source": source, "config_summary": fields,
            "resources": {role: reader.object(oid).bytes for role, oid in comp.resources.items()},
            "proposal": comp.proposal,
        })
    by_component: dict[str, dict[str, int]] = {}
    by_format: dict[str, dict[str, int]] = {}
    for obj in d.objects:
        shared = len(owners[obj.id]) > 1
        for key in sorted(owners[obj.id]) or [UNREFERENCED]:
            row = by_component.setdefault(key, {"objects": 0, "bytes": 0, "shared_objects": 0})
            row["objects"] += 1
            row["bytes"] += obj.bytes
            row["shared_objects"] += int(shared)
        fmt = obj.format if obj.is_tensor else f"resource:{obj.encoding}"
        row = by_format.setdefault(fmt, {"objects": 0, "bytes": 0})
        row["objects"] += 1
        row["bytes"] += obj.bytes
    tensors = sum(1 for o in d.objects if o.is_tensor)
    classes: dict[str, dict[str, int]] = {}
    for name, binding in d.bindings.items():
        key = re.sub(r"/\d+(?=/|$)", "/*", name)
        fmt = "+".join(sorted({d.object_index[oid].format or "?" for oid in binding.object_ids()}))
        row = classes.setdefault(key, {})
        row[fmt] = row.get(fmt, 0) + 1
    return {
        "path": str(reader.path),
        "artifact_id": reader.artifact_id,
        "name": (d.metadata or {}).get("name"),
        "files": files,
        "components": components,
        "objects": {"count": len(d.objects), "tensors": tensors, "resources": len(d.objects) - tensors,
                    "bytes": sum(o.bytes for o in d.objects)},
        "objects_by_component": by_component,
        "objects_by_format": by_format,
        "parameter_formats": classes,
        "bindings": len(d.bindings),
        "uses": len(d.uses),
        "activation_policies": _policy_counts(d),
        "metadata": d.metadata,
        "provenance": d.provenance,
    }


def _policy_counts(directory) -> dict[str, int]:
    """Uses per activation policy (A16Only, AllowA8, AllowA4); uses without one are not counted."""
    counts: dict[str, int] = {}
    for use in directory.uses:
        if use.activation_policy is not None:
            counts[use.activation_policy] = counts.get(use.activation_policy, 0) + 1
    return counts


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} B ({n / scale:.2f} {unit})"
    return f"{n:,} B"


def _fmt_value(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v)


def describe(reader) -> str:
    """The human-readable ``ninfer info`` text."""
    s = summarize(reader)
    out = [f"artifact:    {s['path']}", f"artifact id: {s['artifact_id']}"]
    if s["name"] is not None:
        out.append(f"name:        {s['name']}")
    out.append(f"files ({len(s['files'])}):")
    for f in s["files"]:
        missing = "" if f["present"] else "  (MISSING)"
        out.append(f"  [{f['index']}] {os.path.basename(f['path'])}  payload {_fmt_bytes(f['payload_bytes'])}{missing}")
    out.append("components:")
    for c in s["components"]:
        target = f"  (targets {c['target']})" if c["target"] else ""
        out.append(f"  {c['id']}: {', '.join(c['architectures'])}{target}")
        fields = ", ".join(f"{k}={_fmt_value(v)}" for k, v in c["config_summary"].items()) or "(no key fields)"
        out.append(f"      config [{c['config_summary_source']}]: {fields}")
        if c["resources"]:
            res = ", ".join(f"{role} ({n:,} B)" for role, n in c["resources"].items())
            out.append(f"      resources: {res}")
        if c["proposal"] is not None:
            out.append(f"      proposal: {_fmt_value(c['proposal'])}")
    o = s["objects"]
    out.append(f"objects: {o['count']} ({o['tensors']} tensors, {o['resources']} resources), "
               f"{_fmt_bytes(o['bytes'])}")
    out.append("  by component:")
    for key, row in sorted(s["objects_by_component"].items()):
        shared = f", {row['shared_objects']} shared" if row["shared_objects"] else ""
        out.append(f"    {key}: {row['objects']} objects{shared}, {_fmt_bytes(row['bytes'])}")
    out.append("  by format:")
    for key, row in sorted(s["objects_by_format"].items()):
        out.append(f"    {key}: {row['objects']} objects, {_fmt_bytes(row['bytes'])}")
    out.append("parameter formats (by class):")
    for key, row in sorted(s["parameter_formats"].items()):
        out.append(f"    {key}: " + ", ".join(f"{fmt} x{n}" for fmt, n in sorted(row.items())))
    out.append(f"bindings: {s['bindings']}; uses: {s['uses']}")
    if s["activation_policies"]:
        out.append("activation policies (uses): " + ", ".join(
            f"{pol} x{n}" for pol, n in sorted(s["activation_policies"].items())))
    for key in ("metadata", "provenance"):
        if s[key] is not None:
            out.append(f"{key}: {json.dumps(s[key], ensure_ascii=False, sort_keys=True)}")
    return "\n".join(out)
