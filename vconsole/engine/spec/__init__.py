"""N-gram speculative decoding (vLLM's ``ngram`` method): drafts looked up in a request's own
tokens (`ngram`), verified against the model's logits at every draft position of the row in
one forward (`rejection`). The scheduler schedules the drafts as extra tokens of the decode row
and rolls back what was rejected; the model runner proposes and verifies."""
