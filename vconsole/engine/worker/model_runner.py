"""The model runner: turns one `SchedulerOutput` into one forward pass and sampled tokens.

The runner never sees the scheduler's `Request`: it keeps its own copy of each request
(`vconsole.engine.worker.request_state`), built from the plain data of
`vconsole.engine.sched.output`, as a worker in another process would.

All scheduled tokens of all requests go through the model as one packed sequence (1, T); the
paged attention (`vconsole.engine.worker.paged_attention`) writes their K/V into the block pool and reads each
request's context back through its block table. Only the rows that must be sampled reach the
LM head, and the prompt rows of requests that asked for prompt logprobs
(`vconsole.engine.worker.prompt_logprobs`).

Per step the host builds every index (token ids, positions, slots, block tables, context
lengths, context slots, sample rows) into one flat Python list and moves it to the device in one
copy (on CUDA from pinned memory, non-blocking); the pieces are views into that tensor. The only
device -> host sync is reading the sampled tokens back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence

import torch

from vconsole.engine.sched.output import ModelRunnerOutput, SchedulerOutput
from vconsole.engine.worker import (
    attention_kernel,
    kv_quant,
    native_decode,
    paged_attention,
    prompt_logprobs,
    step_inputs,
    weight_format,
)
from vconsole.engine.worker.fused_decoder import FusedDecoder
from vconsole.engine.worker.kv_open_blocks import OpenBlocks
from vconsole.engine.worker.model_loader import load_model
from vconsole.engine.worker.paged_attention import DecodeGroup, PagedAttentionMetadata, PrefillChunk
from vconsole.engine.worker.prompt_logprobs import PromptRows
from vconsole.engine.worker.request_state import RequestStates, ScheduledSeq
from vconsole.engine.worker.sampler import Sampler, SamplingBatch, apply_grammar
from vconsole.engine.worker.spec_verify import DraftVerifier
from vconsole.engine.worker.step_inputs import (
    PreparedStep,
)
from vconsole.shared.config import EngineConfig
from vconsole.shared.speculative import parse_speculative_config

_GIB = 1 << 30
# "transformers": run transformers' own decoder forward instead of `FusedDecoder` (the
# benchmarks' before/after, and a way out should a model misbehave on the fused path).
FORWARD_ENV = "VCONSOLE_FORWARD"


class ModelRunner:
    """Owns the model, the tokenizer, the KV block pool and the sampler.

    Lifecycle: construct (loads weights), ``determine_num_blocks``, ``allocate_kv_cache``, then
    ``execute_model`` once per step. Everything runs under ``torch.inference_mode``.
    """

    def __init__(self, config: EngineConfig) -> None:
        native_decode.wanted()      # VCONSOLE_DECODE_STEP other than native/python: refused now
        self.config = config
        # collect_detailed_traces (set by the engine core): time each forward, the latest's ns
        self.time_forward = False
        self.last_forward_ns = 0
        self._step_t0 = 0.0            # execute_model's start (perf_counter), for step costs
        self.model, self.tokenizer, self.info = load_model(config.model, config.device,
                                                           config.dtype, seed=config.seed)
        first = next(self.model.parameters())
        self.device: torch.device = first.device
        self.dtype: torch.dtype = first.dtype
        self.eos_token_ids: tuple[int, ...] = self.info.eos_token_ids
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None
        self.vocab_size: int = self.info.vocab_size
        limit = self.info.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        self.max_model_len: int = config.max_model_len or limit
        self.num_layers = self.info.num_layers
        self.num_kv_heads = self.info.num_kv_heads
        self.head_dim = self.info.head_dim
        self.kv_format = kv_quant.kv_format(config.kv_cache_dtype)
        if self.kv_format.bits == 4 and self.head_dim % 2:
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} needs an even head_dim; "
                             f"this model's is {self.head_dim}")
        # A per-channel format's open blocks (`kv_open_blocks`), staged in the block the KV
        # manager lends each running request: its live map, wired by the engine core.
        self.open_blocks: OpenBlocks | None = None
        self.staging_of: Mapping[str, int] = {}
        self.sampler = Sampler(self.device, config.seed)
        self.kv_caches: kv_quant.KVCache = []
        self._workspace = paged_attention.Workspace()
        self.num_blocks = 0
        self.block_size = config.block_size
        # int8, a GGUF's blocks as stored (`weight_format`), or None: the model's dtype
        self.weights: str | None = weight_format.apply(self.model, config, self.device.type)
        self._decoder = self.model.get_decoder()
        self._lm_head = self.model.get_output_embeddings()
        self._decode_kernel = (attention_kernel.load()
                               if self.device.type == "cpu" and self.dtype == torch.float32
                               else None)
        self.fused_decoder = (None if os.environ.get(FORWARD_ENV) == "transformers"
                       else FusedDecoder.build(self.model))
        if self.fused_decoder is not None:      # small decode steps in one native call (#47)
            self.fused_decoder.use_native(self._decode_kernel)
        self.requests = RequestStates()
        spec = parse_speculative_config(config.speculative_config)
        self.drafts = (None if spec is None else
                       DraftVerifier(spec, self.sampler, self.vocab_size, self.device))

    # --- memory ------------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer as the pool stores them (quantization
        parameters included; a per-channel format's per-block ones shared out, rounded up)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.kv_format.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                              itemsize, self.config.block_size)

    @property
    def kv_staging_bytes(self) -> int:
        """Staging beside the pool: none (a per-channel format's open blocks are staged in
        blocks of the pool, one lent to each running request, `kv_quant.staging_view`)."""
        return 0

    @property
    def kv_cache_dtype(self) -> str:
        """The pool's storage: a quantized format's name, or the model's dtype (``float32``)."""
        if self.kv_format.quantized:
            return self.kv_format.name
        return str(self.dtype).removeprefix("torch.")

    @property
    def kv_pool_bytes(self) -> int:
        """What the allocated pool takes: its blocks (a per-channel format's staging in them)."""
        return self.num_blocks * self.kv_cache_bytes_per_block(self.block_size) \
            + self.kv_staging_bytes

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.kv_format.bytes_per_block(block_size, self.num_layers, self.num_kv_heads,
                                              self.head_dim, itemsize)

    def determine_num_blocks(self) -> int:
        """How many KV blocks the pool gets.

        ``num_kv_blocks`` wins when set, then ``kv_cache_memory_bytes``. On CUDA the budget is
        ``gpu_memory_utilization`` of the device minus what is already in use (weights, other
        processes) minus a reserve for activations; on CPU it is ``cpu_kv_cache_gib``. The
        bytes per block are the stored format's (`kv_quant`): a quantized pool holds more.
        """
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.kv_cache_bytes_per_block(cfg.block_size)
        if cfg.kv_cache_memory_bytes is not None:
            num_blocks = self._blocks_in(cfg.kv_cache_memory_bytes, per_block)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes {cfg.kv_cache_memory_bytes} holds no "
                                 f"block: one block of {cfg.block_size} tokens takes "
                                 f"{per_block} bytes ({self.kv_cache_dtype})")
            return num_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cfg.gpu_memory_utilization - (total - free) - self._activation_reserve()
        else:
            budget = cfg.cpu_kv_cache_gib * _GIB
        num_blocks = self._blocks_in(int(budget), per_block)
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache (budget {budget / _GIB:.2f} GiB, "
                             f"{per_block} bytes per block); raise gpu_memory_utilization / "
                             "cpu_kv_cache_gib or set num_kv_blocks / kv_cache_memory_bytes")
        return num_blocks

    @staticmethod
    def _blocks_in(budget: int, per_block: int) -> int:
        """Blocks that ``budget`` bytes hold (a per-channel format's staging is in them)."""
        return int(budget // per_block)

    def _activation_reserve(self) -> int:
        """A conservative bound on one step's transient memory (hidden states, MLP
        intermediates, logits and sampler buffers) plus allocator slack."""
        cfg, info = self.config, self.info
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        inter = getattr(self.model.config, "intermediate_size", 4 * info.hidden_size)
        per_token = (8 * info.hidden_size + 3 * inter + 4 * info.num_heads * info.head_dim)
        act = cfg.max_num_batched_tokens * per_token * itemsize
        logits = cfg.max_num_seqs * info.vocab_size * 4 * 8
        # Prompt logprobs: a slice of SLICE_ROWS float32 rows x vocab, ~3 at once (the LM
        # head's logits, their log-softmax, the rank comparison).
        prompt_lps = prompt_logprobs.SLICE_ROWS * info.vocab_size * 4 * 3
        return act + logits + prompt_lps + 512 * (1 << 20)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the pool once: per layer a zeroed K and V of
        (num_blocks, block_size, num_kv_heads, head_dim) in the model's dtype and device, or
        their quantized data and parameters (`kv_quant`)."""
        self.kv_caches = []  # drop an old pool before allocating the new one
        self.kv_caches = kv_quant.allocate(
            self.kv_format, self.num_layers, num_blocks, block_size, self.num_kv_heads,
            self.head_dim, self.dtype, self.device)
        self.open_blocks = (OpenBlocks(num_blocks, block_size, self.device)
                            if self.kv_format.key_per_channel else None)
        self.num_blocks = num_blocks
        self.block_size = block_size

    # --- one step ----------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward for every scheduled sequence and sample where ``do_sample``."""
        self._step_t0 = time.perf_counter()
        seqs = self.requests.apply(so)
        with torch.inference_mode():
            step = self.prepare(seqs)
            if step is None:
                return ModelRunnerOutput()
            t_forward = time.monotonic_ns() if self.time_forward else 0
            logits = self._forward(step)
            if self.time_forward:       # collect_detailed_traces: the forward's own time
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.last_forward_ns = time.monotonic_ns() - t_forward
            prompt_lps = self._prompt_logprobs(step)
            if logits is None:
                return ModelRunnerOutput()
            spec_sampled: dict[str, list[int]] = {}
            seqs_sampled = step.sample_seqs
            if self.drafts is not None and any(s.draft for s in seqs_sampled):
                logits, seqs_sampled = self.drafts.verify_rows(logits, seqs_sampled,
                                                               spec_sampled)
            states = [s.state for s in seqs_sampled]
            if not states:
                return ModelRunnerOutput(spec_sampled=spec_sampled, prompt_logprobs=prompt_lps,
                                         draft_token_ids=self._propose(so, {}, spec_sampled))
            structured_ns = 0
            if so.grammar is not None:
                structured_ns = apply_grammar(logits, [st.req_id for st in states],
                                              so.grammar)
            batch = SamplingBatch.build([st.sampling for st in states],
                                        [st.num_output_tokens for st in states],
                                        self.vocab_size, self.device,
                                        token_ids=[st.token_ids for st in states],
                                        num_prompt_tokens=[st.num_prompt_tokens
                                                           for st in states],
                                        eos_token_ids=self.eos_token_ids)
            sampled = self.sampler(logits, batch)
            tokens = sampled.tolist()
            asked = [(i, st.sampling.logprobs) for i, st in enumerate(states)
                     if st.sampling.logprobs is not None]
            logprobs = {}
            if asked:
                rows, top = zip(*asked, strict=True)
                logprobs = {states[i].req_id: entry for i, entry in zip(
                    rows, self.sampler.logprobs(logits, sampled, rows, top), strict=True)}
        sampled_out = {st.req_id: t for st, t in zip(states, tokens, strict=True)}
        return ModelRunnerOutput(sampled_out, logprobs, prompt_lps, structured_ns,
                                 spec_sampled=spec_sampled,
                                 draft_token_ids=self._propose(so, sampled_out, spec_sampled))

    def _propose(self, so: SchedulerOutput, sampled: dict[str, int],
                 spec_sampled: dict[str, list[int]]) -> dict[str, list[int]]:
        """The next step's drafts (`spec_verify.DraftVerifier.propose`); none without
        speculation."""
        if self.drafts is None:
            return {}
        if so.num_prefill_tokens == 0:      # the step's cost by its width, for draft lengths
            self.drafts.costs.observe(so.total_num_scheduled_tokens,
                                      time.perf_counter() - self._step_t0)
        return self.drafts.propose(so, self.requests, sampled, spec_sampled)

    def _prompt_logprobs(self, step: PreparedStep) -> dict[str, prompt_logprobs.PromptLogprobs]:
        """Score this step's prompt rows into their requests' states; the prompts completed
        now, whole."""
        if step.prompt is not None and step.prompt_hidden is not None:
            assert step.prompt_targets is not None
            scored = prompt_logprobs.score_rows(self._lm_head, step.prompt_hidden,
                                                step.prompt_targets, step.prompt.top_k)
            prompt_logprobs.accumulate(step.prompt, scored)
        return prompt_logprobs.take_finished(step.sample_seqs)

    def compute_logits(self, so: SchedulerOutput) -> dict[str, torch.Tensor]:
        """Like `execute_model` (K/V are written the same way) but return the float32 logits
        of each ``do_sample`` request's last position instead of sampling (a draft row's:
        (1 + draft, V), one per position). A request asking for
        prompt logprobs is refused (ValueError): they are computed by `execute_model` only."""
        seqs = self.requests.apply(so)
        asking = [s.req_id for s in seqs if s.state.prompt_logprobs is not None]
        if asking:
            raise ValueError(f"compute_logits does not compute prompt logprobs (asked by "
                             f"{', '.join(asking)}); run execute_model")
        with torch.inference_mode():
            step = self.prepare(seqs)
            if step is None:
                return {}
            logits = self._forward(step)
            if logits is None:
                return {}
            out: dict[str, torch.Tensor] = {}
            row, logits = 0, logits.float()
            for s in step.sample_seqs:      # a draft row: (1 + draft, V), every position's
                n = s.num_tokens if s.draft else 1
                out[s.state.req_id] = logits[row] if n == 1 and not s.draft \
                    else logits[row:row + n]
                row += n
            return out

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> PreparedStep | None:
        """Pack the step: single-token sequences first (they share one batched attention
        call), then prefill chunks. Returns None for an empty step."""
        if not seqs or not self.kv_caches:
            if seqs:
                raise RuntimeError("allocate_kv_cache must be called before execute_model")
            return None
        bs = self.block_size
        decodes = sorted((s for s in seqs if s.num_tokens == 1), key=lambda s: s.start_pos)
        chunks = [s for s in seqs if s.num_tokens > 1]
        ordered = decodes + chunks
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for s in decodes:
            p = s.start_pos
            ids.append(s.state.token_ids[p])
            pos.append(p)
            slots.append(s.block_ids[p // bs] * bs + p % bs)
        for s in chunks:
            end = s.start_pos + s.num_tokens
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, end))
            slots.extend(step_inputs.slots(s.block_ids, s.start_pos, end, bs))
        num_tokens = len(ids)

        # Decode block tables per group (rows sorted by context length), each padded with
        # block 0 to its group's longest context (masked out by context length).
        groups = step_inputs.decode_groups(len(decodes))
        group_blocks: list[int] = []
        tables: list[int] = []
        for lo, hi in groups:
            max_blocks = decodes[hi - 1].start_pos // bs + 1
            group_blocks.append(max_blocks)
            for s in decodes[lo:hi]:
                step_inputs.padded_table(tables, s.block_ids, s.start_pos, bs, max_blocks)
        ctx_lens = [s.start_pos + 1 for s in decodes]
        view_blocks, view_tables, view_lens = step_inputs.decode_view(
            ordered, chunks, num_tokens, self.block_size, self.native_decode_rows)

        # Prefill chunks that continue a request read their whole context from the pool: by
        # slot (the torch path), and by block table (the CPU kernel, for a quantized pool).
        ctx_slots: list[int] = []
        chunk_spans: list[tuple[int, int]] = []
        chunk_tables: list[int] = []
        table_spans: list[tuple[int, int]] = []
        for s in chunks:
            if s.start_pos == 0:
                chunk_spans.append((0, 0))
                table_spans.append((0, 0))
            else:
                end = s.start_pos + s.num_tokens
                lo = len(ctx_slots)
                ctx_slots.extend(step_inputs.slots(s.block_ids, 0, end, bs))
                chunk_spans.append((lo, len(ctx_slots)))
                lo = len(chunk_tables)
                chunk_tables.extend(s.block_ids[:-(-end // bs)])
                table_spans.append((lo, len(chunk_tables)))

        sample_rows: list[int] = []
        sample_seqs: list[ScheduledSeq] = []
        prompt = PromptRows()
        offset = 0
        for s in ordered:
            if s.state.prompt_logprobs is not None:
                prompt.add(s, offset)
            offset += s.num_tokens
            if s.do_sample:
                if s.draft:       # a draft row: every position's logits verify the draft
                    sample_rows.extend(range(offset - s.num_tokens, offset))
                else:
                    sample_rows.append(offset - 1)
                sample_seqs.append(s)

        flat = (ids + pos + slots + tables + ctx_lens + ctx_slots + chunk_tables + sample_rows
                + prompt.rows + prompt.targets + view_tables + view_lens)
        buf = torch.tensor(flat, dtype=torch.int64)
        if self.device.type == "cuda":
            # From pinned memory the copy is queued on the stream without waiting for it.
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        sizes = [num_tokens, num_tokens, num_tokens, len(tables), len(ctx_lens), len(ctx_slots),
                 len(chunk_tables), len(sample_rows), len(prompt.rows), len(prompt.targets),
                 len(view_tables), len(view_lens)]
        (t_ids, t_pos, t_slots, t_tables, t_lens, t_ctx, t_chunk_tables, t_rows, t_prompt_rows,
         t_targets, t_view_tables, t_view_lens) = torch.split(buf, sizes)

        prefills: list[PrefillChunk] = []
        offset = len(decodes)
        for s, (lo, hi), (tlo, thi) in zip(chunks, chunk_spans, table_spans, strict=True):
            prefills.append(PrefillChunk(offset, s.num_tokens, s.start_pos,
                                         t_ctx[lo:hi] if s.start_pos else None,
                                         t_chunk_tables[tlo:thi] if s.start_pos else None,
                                         draft=bool(s.draft and s.start_pos)))
            offset += s.num_tokens
        decode_groups: list[DecodeGroup] = []
        t_at = 0
        for (lo, hi), mb in zip(groups, group_blocks, strict=True):
            rows = (hi - lo) * mb
            decode_groups.append(DecodeGroup(lo, hi, t_tables[t_at:t_at + rows], mb,
                                             t_lens[lo:hi]))
            t_at += rows
        open_plan = None
        if self.open_blocks is not None:
            open_plan = self.open_blocks.plan(step_inputs.block_writes(ordered, bs), self.requests,
                                              self.staging_of)
        meta = PagedAttentionMetadata(
            kv_caches=self.kv_caches, block_size=bs, slot_mapping=t_slots,
            num_decodes=len(decodes), decode_groups=decode_groups, prefills=prefills,
            workspace=self._workspace, decode_kernel=self._decode_kernel,
            kv_format=self.kv_format, open_plan=open_plan,
            decode_view=(DecodeGroup(0, num_tokens, t_view_tables, view_blocks, t_view_lens)
                         if view_lens else None))
        if not prompt.rows:
            return PreparedStep(t_ids[None], t_pos[None], meta, t_rows, sample_seqs)
        return PreparedStep(t_ids[None], t_pos[None], meta, t_rows, sample_seqs, prompt,
                            t_prompt_rows, t_targets)

    @property
    def last_step_native(self) -> bool:
        """Whether the last forward ran as one native call (`native_decode`): the step's
        regime, which the what-if's step-cost model tells apart."""
        return self.fused_decoder is not None and self.fused_decoder.last_native

    @property
    def native_decode_rows(self) -> int:
        """The widest step of decode (and draft) rows that runs as one native call, 0 when
        none does (the trace header's, for the what-if's simulated steps)."""
        fused = self.fused_decoder
        plan = fused.native if fused is not None else None
        return plan.max_rows if plan is not None and not self.kv_format.quantized else 0

    @property
    def forward_path(self) -> str:
        """Which decoder forward runs: ``fused`` (`FusedDecoder`) or ``transformers``."""
        return "fused" if self.fused_decoder is not None else "transformers"

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: PagedAttentionMetadata, rows: torch.Tensor) -> torch.Tensor:
        """The final hidden states (R, hidden) of packed rows ``rows``."""
        if self.fused_decoder is not None:
            return self.fused_decoder.forward(input_ids, positions, meta, rows)
        out = self._decoder(input_ids=input_ids[None], position_ids=positions[None],
                            use_cache=False, **{paged_attention.METADATA_KWARG: meta})
        return out.last_hidden_state[0].index_select(0, rows)

    def _forward(self, step: PreparedStep) -> torch.Tensor | None:
        """One forward over the packed batch; logits (S, V) of the sample rows only. The final
        hidden states of the prompt rows, if any, go to ``step.prompt_hidden``."""
        rows = step.sample_rows
        if step.prompt_rows is not None:
            rows = torch.cat((rows, step.prompt_rows))
        hidden = self._hidden(step.input_ids[0], step.positions[0], step.metadata, rows)
        if step.prompt_rows is not None:
            num = step.sample_rows.shape[0]
            hidden, step.prompt_hidden = hidden[:num], hidden[num:]
        if not step.sample_seqs:
            return None
        return self._lm_head(hidden)

    # --- data parallel -----------------------------------------------------------------------

    def execute_dummy_batch(self) -> None:
        """One minimal forward, a single token at position 0 through the decoder and the LM
        head, that touches no request: its K/V go to a private one-slot scratch pool, never to
        ``kv_caches``, and neither the request states nor the sampler change. A data-parallel
        rank runs it while it has no work inside a wave, so that the group's steps stay in
        lockstep (vLLM's ``execute_dummy_batch``). Built here, independently of `prepare`."""
        with torch.inference_mode():
            scratch = getattr(self, "_dummy_kv_caches", None)
            if scratch is None:
                scratch = kv_quant.allocate(
                    kv_quant.FORMATS["auto"], self.num_layers, 1, 1, self.num_kv_heads,
                    self.head_dim, self.dtype, self.device)
                self._dummy_kv_caches = scratch
            zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
            meta = PagedAttentionMetadata(kv_caches=scratch, block_size=1, slot_mapping=zeros,
                                          prefills=[PrefillChunk(0, 1, 0, None)])
            self._lm_head(self._hidden(zeros, zeros, meta, zeros))
