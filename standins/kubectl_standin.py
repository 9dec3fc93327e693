"""A stand-in for kubectl and the cluster behind it (NOT kubectl, NOT Kubernetes), for `kdtreectl rollout --selector`:
the two commands it runs, with kubectl's arguments, output and errors:

  kubectl --namespace NS get pods --selector K=V[,K=V] --output json   -> a v1 List of the namespace's matching Pods
  kubectl --namespace NS annotate --overwrite pod/NAME KEY=VALUE       -> "pod/NAME annotated"

The cluster is a JSON file (KUBECTL_STANDIN_CLUSTER): {"pods": [Pod, ...], "downward": {"NAME": "FILE"}}. An annotation
of kdtree.dev/desired-mode is also written to the pod's FILE, whole, as the kubelet refreshes a downward API volume
(here at once; the kubelet takes up to its sync period). KUBECTL_STANDIN_DIE_AFTER_ANNOTATE=N: after its Nth
annotation (counted in the cluster file) it kills the process that ran it, as a terminal that dies right after a
step would, for resumability tests.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import sys
from pathlib import Path

ANNOTATION = "kdtree.dev/desired-mode"


def fail(message: str, code: int = 1) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def matches(pod: dict, selector: str) -> bool:
    labels = pod["metadata"].get("labels", {})
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


def main(argv: list[str]) -> None:
    namespace, args, opts = "default", [], {}
    it = iter(argv)
    for a in it:
        if a in ("--namespace", "-n"):
            namespace = next(it)
        elif a in ("--selector", "-l"):
            opts["selector"] = next(it)
        elif a in ("--output", "-o"):
            opts["output"] = next(it)
        elif a == "--overwrite":
            opts["overwrite"] = True
        elif a.startswith("-"):
            fail(f"unknown flag: {a}")
        else:
            args.append(a)
    path = Path(os.environ["KUBECTL_STANDIN_CLUSTER"])
    with path.open("r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # several kdtreectl threads may run it at once
        cluster = json.load(f)
        pods = [p for p in cluster["pods"] if p["metadata"]["namespace"] == namespace]
        if args[:2] == ["get", "pods"]:
            if opts.get("output") != "json":
                fail("the stand-in answers --output json only")
            items = [p for p in pods if matches(p, opts.get("selector", ""))]
            print(
                json.dumps(
                    {"apiVersion": "v1", "kind": "List", "items": items, "metadata": {"resourceVersion": ""}}
                )
            )
            return
        if args[:1] == ["annotate"] and len(args) == 3 and args[1].startswith("pod/"):
            name = args[1].removeprefix("pod/")
            key, eq, value = args[2].partition("=")
            found = [p for p in pods if p["metadata"]["name"] == name]
            if not found or not eq:
                fail(f'pods "{name}" not found' if not found else f"invalid annotation: {args[2]}")
            annotations = found[0]["metadata"].setdefault("annotations", {})
            if key in annotations and not opts.get("overwrite"):
                fail(
                    f"--overwrite is false but found the following declared annotation(s): '{key}' already has a "
                    f"value ({annotations[key]})"
                )
            annotations[key] = value
            if key == ANNOTATION and name in cluster.get("downward", {}):
                target = Path(cluster["downward"][name])
                tmp = target.with_name(".kubelet-" + target.name)
                tmp.write_text(value)
                os.replace(tmp, target)
            cluster["annotations_made"] = cluster.get("annotations_made", 0) + 1
            f.seek(0)
            f.truncate()
            json.dump(cluster, f)
            f.flush()
            print(f"pod/{name} annotated")
            die_after = os.environ.get("KUBECTL_STANDIN_DIE_AFTER_ANNOTATE")
            if die_after and cluster["annotations_made"] == int(die_after):
                sys.stdout.flush()
                os.kill(os.getppid(), signal.SIGKILL)
            return
    fail(f"the stand-in does not know `kubectl {' '.join(argv)}`")


if __name__ == "__main__":
    main(sys.argv[1:])
