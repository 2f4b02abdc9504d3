"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a
grammar, with llguidance (vLLM's ``vllm/v1/structured_output/``, its guidance backend).

- `grammar`: a `StructuredSpec` as llguidance grammar text (`to_grammar`), and `check_spec`,
  which needs no tokenizer (the HTTP server answers 400 with it before anything streams);
- `compiler`: compiles each spec once (an LRU cache keyed by the spec) on the engine's compile
  thread, never on the busy loop;
- `manager`: the engine core's side: per request its matcher, per step one bitmask for every
  constrained row that samples, and the matchers advanced with the sampled tokens.
"""
