"""``ninfer info MODEL.ninfer``: components, config summary, objects, files and metadata of an artifact.

Reads the directory only; ``--verify`` additionally streams every object and checks its checksum
(opening every part), failing with the artifact error that names the first bad object or file.
"""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("info", help="describe a .ninfer artifact",
                       description="Describe a V3 .ninfer artifact: components and config summary, objects "
                                   "and bytes per component and per format, files, metadata, artifact id.")
    p.add_argument("model", metavar="MODEL.ninfer", help="the artifact's entry file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--verify", action="store_true", help="also read every object and check its checksum")
    p.set_defaults(func=run)


def run(args) -> int:
    from ninfer.artifact import ArtifactReader, describe, summarize

    with ArtifactReader.open(args.model) as reader:
        if args.verify:
            for obj in reader.directory.objects:
                reader.verify_object(obj.id)
        if args.json:
            out = summarize(reader)
            if args.verify:
                out["verified"] = True
            print(json.dumps(out, indent=2, ensure_ascii=False))
        else:
            print(describe(reader))
            if args.verify:
                print(f"verified: all {len(reader.directory.objects)} object checksums match")
    return 0
