"""Every message both sides of a socket import, and nothing of either side.

- `protocol`: the request sockets' frames (``add``, ``abort``, ``outputs``, ``ready`` …), with
  the data they carry: `sampling` (what a request asks for: `SamplingParams`, `StructuredSpec`)
  and `outputs` (what comes back: `RequestOutput`, `PromptLogprobs`).
- `control`: the control socket's requests and replies; `control_client`: its blocking client.
- `exit_codes`, `ready_file`, `liveness`: what an engine process tells whoever started it (how
  it exited, where it listens, that it still steps).

Why a package of its own (as vLLM keeps ``EngineCoreRequest`` and ``EngineCoreOutputs`` in
``vllm/v1/engine/__init__.py``, imported by both ``core.py`` and ``core_client.py``): the engine
process, its clients, its launchers and the console each import the wire, so none of them has
to import another to agree on a format. It imports only `vconsole.shared` and
`vconsole.security` (contract ``wire`` in pyproject.toml).
"""
