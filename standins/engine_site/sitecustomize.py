"""Runs at the start of every process of a real SGLang server in the GPU tests (this folder is on its PYTHONPATH:
kernel_build/bench/harness/real_server.py): the stand-ins for what the GPU machine lacks are in place before anything imports SGLang
(standins/sglang_stubs.py, found beside this folder). In the tests' sitecustomize configuration kdtree's own
sitecustomize comes first on the path and runs this one, as it runs any sitecustomize it shadows; this one in turn
runs the next one after it on the path, if the machine has one."""

import os
import sys

import ddtree_oracle  # imports nothing of SGLang's
import sglang_stubs  # noqa: F401

# the oracle servers, the sync report and the host report, where their variables ask for them
# (kernel_build/bench/harness/ddtree_oracle.py, on the path beside this folder)
ddtree_oracle.install_after_import()


def _run_next_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    dirs = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    for directory in dirs[dirs.index(here) + 1 :] if here in dirs else []:
        candidate = os.path.join(directory, "sitecustomize.py")
        if os.path.isfile(candidate):
            import runpy

            runpy.run_path(candidate, run_name="sitecustomize")
            return


_run_next_sitecustomize()
