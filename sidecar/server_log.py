"""What the server's own log says (its lines, not the ranks' records): the latest startup marker, and the error lines of a crash."""

from __future__ import annotations

import re

from pydantic import BaseModel

from kdtree.state.process_record import START_MARK

# SGLang 0.5.23 prints these, in this order, on a healthy start (weights, CUDA graphs, HTTP up); each is a regular
# expression. Its graph lines name what is captured: "Capture target verify CUDA graph begin. backend=full, ..."
# (speculative decoding), then the draft model's ("Capture draft decode CUDA graph begin. ..."); older versions
# printed "Capture cuda graph begin". tests/gpu/test_engine_gpu.py checks the list against a real server's log,
# tests/sidecar/test_sidecar_probe.py against an excerpt of it (tests/data/sglang-0.5.23-startup.log).
LOG_MARKERS = (
    ("loading_weights", r"Load weight begin\b"),
    ("weights_loaded", r"Load weight end\b"),
    ("capturing_cuda_graphs", r"(?i:Capture [\w ]*cuda graph begin)"),
    ("cuda_graphs_captured", r"(?i:Capture [\w ]*cuda graph end)"),
    ("fired_up", r"The server is fired up and ready to roll!"),
)
_MARKERS = tuple((name, re.compile(pattern)) for name, pattern in LOG_MARKERS)

_ERROR_LINE = re.compile(
    r"Traceback \(most recent call last\)|\b\w*(Error|Exception)\b|\bERROR\b|\bFATAL\b|out of memory|"
    r"\bKilled\b|Segmentation fault|core dumped|NCCL WARN|"
    # The server's entrypoint: a refused configuration, or the server killed by a signal.
    r"^kdtree launcher: (?:error:|the server was killed)",
)
# A client that hung up (a request abandoned during a hang, say): the server survives it, so it explains no exit.
# socketserver's handle_error heads such a traceback with its own line.
_HANG_UP = re.compile(r"^(?:BrokenPipeError|ConnectionResetError|ConnectionAbortedError)\b")
_NOT_AN_ERROR = re.compile(r"^Exception occurred during processing of request from ")
# Ordinary lines that may separate the errors of one incident (ranks failing one after another, the shutdown).
INCIDENT_GAP = 20


class LogMarker(BaseModel):
    name: str
    text: str
    line: str


def latest_marker(log: str) -> LogMarker | None:
    """The last startup marker in the log (`text`: what matched), with the line that carried it."""
    latest = None
    for line in log.splitlines():
        for name, pattern in _MARKERS:
            if m := pattern.search(line):
                latest = LogMarker(name=name, text=m.group(0), line=line.strip()[:300])
    return latest


def crash_excerpt(log: str, max_lines: int = 40) -> list[str]:
    """The lines that explain how this run ended: in this run's lines (after the launcher's last start mark), the
    last incident (error lines and whole tracebacks, up to the exception line, with at most INCIDENT_GAP other
    lines between them), its last max_lines lines. Errors of earlier incidents (a hang's abandoned requests,
    a warning hours before) and of earlier runs are left out."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(START_MARK)]
    if starts:
        lines = lines[starts[-1] + 1 :]
    incidents: list[list[str]] = []
    last_end = None  # the index after the last error item
    i = 0
    while i < len(lines):
        first = i
        line = lines[i]
        if "Traceback (most recent call last)" in line:
            i += 1
            # A traceback body is indented; its first unindented line is the exception itself.
            while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i].strip()):
                i += 1
            i = min(i + 1, len(lines))
            if _HANG_UP.match(lines[i - 1]):
                continue
        elif _ERROR_LINE.search(line) and not _NOT_AN_ERROR.match(line):
            i += 1
        else:
            i += 1
            continue
        if last_end is None or first - last_end > INCIDENT_GAP:
            incidents.append([])
        incidents[-1].extend(lines[first:i])
        last_end = i
    picked = incidents[-1] if incidents else []
    return [p.rstrip()[:500] for p in picked if p.strip()][-max_lines:]
