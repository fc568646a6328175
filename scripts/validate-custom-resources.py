"""Validates the example custom resources (deploy/examples/claims/) against the CRDs in
deploy/tessera.yaml as the API server would: the CRD's openAPIV3Schema (JSON Schema, `nullable`
honoured), and no field the schema does not name (the API server would prune it; kubectl's
strict validation refuses it). Built-in kinds are written to OUT for kubernetes-validate.

usage: python validate-custom-resources.py deploy/tessera.yaml OUT EXAMPLE.yaml...
"""
import copy
import sys

import jsonschema
import yaml


def openapi_to_jsonschema(s):
    s = copy.deepcopy(s)
    if isinstance(s, dict):
        if s.pop("nullable", False) and "type" in s:
            s["type"] = [s["type"], "null"]
        if s.pop("x-kubernetes-int-or-string", False):
            s.pop("type", None)
            s["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        for k in list(s):
            if k.startswith("x-kubernetes-"):
                del s[k]
        for k in ("properties",):
            if k in s:
                s[k] = {n: openapi_to_jsonschema(v) for n, v in s[k].items()}
        for k in ("items", "additionalProperties"):
            if isinstance(s.get(k), dict):
                s[k] = openapi_to_jsonschema(s[k])
    return s


def unknown_fields(value, schema, path):
    """Fields the structural schema does not name (what the API server prunes)."""
    if isinstance(value, dict) and "properties" in schema and "additionalProperties" not in schema:
        for k, v in value.items():
            if path == "" and k in ("apiVersion", "kind", "metadata"):
                continue
            if k not in schema["properties"]:
                yield f"{path}.{k}"
            else:
                yield from unknown_fields(v, schema["properties"][k], f"{path}.{k}")
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for k, v in value.items():
            yield from unknown_fields(v, schema["additionalProperties"], f"{path}.{k}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            yield from unknown_fields(v, schema["items"], f"{path}[{i}]")


def main():
    install, out, examples = sys.argv[1], sys.argv[2], sys.argv[3:]
    crds = {}
    for d in yaml.safe_load_all(open(install)):
        if d and d["kind"] == "CustomResourceDefinition":
            for v in d["spec"]["versions"]:
                crds[(f'{d["spec"]["group"]}/{v["name"]}', d["spec"]["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    builtin, failed, checked = [], 0, 0
    for f in examples:
        for d in yaml.safe_load_all(open(f)):
            if not d:
                continue
            key = (d.get("apiVersion"), d.get("kind"))
            if key[0].startswith("tessera.io/"):
                if key not in crds:
                    print(f"{f}: {key[1]} {key[0]} has no CRD in {install}")
                    failed += 1
                    continue
                schema = crds[key]
                errors = [e.message for e in jsonschema.Draft7Validator(openapi_to_jsonschema(schema)).iter_errors(d)]
                errors += [f"unknown field {p}" for p in unknown_fields(d, schema, "")]
                for e in errors:
                    print(f"{f}: {key[1]} {d['metadata']['name']}: {e}")
                failed += bool(errors)
                checked += 1
            else:
                builtin.append(d)
    with open(out, "w") as o:
        yaml.safe_dump_all(builtin, o)
    if failed:
        sys.exit(1)
    print(f"{checked} custom resources valid against their CRDs; {len(builtin)} built-in objects to {out}")


main()
