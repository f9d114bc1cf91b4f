"""Reading HF checkpoint folders: config, safetensors headers, shards and their index."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from convert_synth_ckpt import raw_bytes, synth_tensors, write_checkpoint
from ninfer.conversion.errors import SourceError
from ninfer.conversion.source import open_checkpoint
from safetensors import safe_open


def _check_against_safetensors(ckpt, tensors):
    assert list(ckpt.tensors) == sorted(ckpt.tensors, key=lambda n: (ckpt.locations[n].file,
                                                                      ckpt.locations[n].offset))
    assert set(ckpt.tensors) == set(tensors)
    for name, t in tensors.items():
        st = ckpt.tensors[name]
        loc = ckpt.locations[name]
        with safe_open(str(ckpt.folder / loc.file), "pt") as f:
            assert name in f.keys()
            assert list(st.shape) == list(f.get_slice(name).get_shape())
            assert st.dtype == f.get_slice(name).get_dtype()
        with open(ckpt.folder / loc.file, "rb") as f:
            f.seek(loc.offset)
            assert f.read(loc.nbytes) == raw_bytes(t), name


def test_single_file_headers_match_safetensors(tmp_path):
    tensors = synth_tensors(vision=True, mtp=True)
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "ck", tensors))
    assert ckpt.architecture == "SynthForCausalLM"
    assert [f.name for f in ckpt.weight_files] == ["model.safetensors"]
    assert ckpt.index is None
    _check_against_safetensors(ckpt, tensors)


def test_sharded_with_index(tmp_path):
    tensors = synth_tensors()
    ckpt = open_checkpoint(write_checkpoint(tmp_path / "ck", tensors, shards=3))
    assert len(ckpt.weight_files) == 3 and ckpt.index is not None
    _check_against_safetensors(ckpt, tensors)


def test_index_wins_over_a_stray_consolidated_file(tmp_path):
    tensors = synth_tensors()
    folder = write_checkpoint(tmp_path / "ck", tensors, shards=2)
    # A consolidated copy beside the shards would duplicate every tensor if it were read.
    write_checkpoint(tmp_path / "other", tensors)
    (tmp_path / "other" / "model.safetensors").rename(folder / "consolidated.safetensors")
    ckpt = open_checkpoint(folder)
    assert "consolidated.safetensors" not in {f.name for f in ckpt.weight_files}


def test_missing_config_names_folder(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    (folder / "config.json").unlink()
    with pytest.raises(SourceError, match=r"ck.*has no config\.json"):
        open_checkpoint(folder)


def test_missing_weights_names_folder_and_hint(tmp_path):
    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["SynthForCausalLM"]}))
    with pytest.raises(SourceError, match=r"ck.*has no \*\.safetensors weights$"):
        open_checkpoint(folder)
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(SourceError, match=r"found pytorch_model\.bin"):
        open_checkpoint(folder)


def test_missing_folder(tmp_path):
    with pytest.raises(SourceError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")


def test_config_without_architectures(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    (folder / "config.json").write_text(json.dumps({"model_type": "x"}))
    with pytest.raises(SourceError, match="architectures"):
        open_checkpoint(folder)


def test_duplicate_tensor_across_files_without_index(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    write_checkpoint(tmp_path / "b", {"lm_head.weight": torch.zeros(2, 2)})
    (tmp_path / "b" / "model.safetensors").rename(folder / "zz.safetensors")
    with pytest.raises(SourceError, match=r"'lm_head\.weight' is stored twice.*model\.safetensors.*zz"):
        open_checkpoint(folder)


def test_index_naming_an_absent_tensor(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"'model\.ghost\.weight'"):
        open_checkpoint(folder)


def test_index_mapping_a_tensor_to_a_non_file_name_names_it(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = 3
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"'weight_map' maps 'lm_head\.weight' to 3, not to a file name"):
        open_checkpoint(folder)
    index["weight_map"] = {}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"no non-empty 'weight_map'"):
        open_checkpoint(folder)


def test_shard_tensor_missing_from_index(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), shards=2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"]["lm_head.weight"]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"'lm_head\.weight'.*missing from model\.safetensors\.index\.json"):
        open_checkpoint(folder)


def test_index_naming_a_missing_shard(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1), shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceError, match=r"model-00002-of-00002\.safetensors"):
        open_checkpoint(folder)


def test_truncated_weight_file(tmp_path):
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(SourceError, match=r"data_offsets .* do not lie inside"):
        open_checkpoint(folder)
    path.write_bytes(data[:5])
    with pytest.raises(SourceError, match="not a safetensors file"):
        open_checkpoint(folder)


def _rewrite_header(path, edit) -> None:
    """``path``'s safetensors header passed through ``edit`` (same length, space padded), the data unchanged."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    path.write_bytes(data[:8] + text + b" " * (n - len(text)) + data[8 + n:])


def test_overlapping_or_gapped_tensor_data_is_refused(tmp_path):
    """Offsets that lie inside the file but overlap another tensor's bytes (one tensor would read another's) or
    leave bytes after the last tensor: refused naming the tensor or the file, as safetensors itself refuses them."""
    folder = write_checkpoint(tmp_path / "ck", synth_tensors(layers=1))
    path = folder / "model.safetensors"
    data = path.read_bytes()

    def shift_last(header):
        name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        begin, end = header[name]["data_offsets"]
        header[name]["data_offsets"] = [begin - 2, end - 2]

    _rewrite_header(path, shift_last)
    with pytest.raises(SourceError, match=r"tensor '.*': its data starts at byte .* contiguous, without gaps"):
        open_checkpoint(folder)
    path.write_bytes(data + b"\0" * 8)
    with pytest.raises(SourceError, match="8 bytes follow the last tensor's data"):
        open_checkpoint(folder)
