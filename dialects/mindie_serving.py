"""The body of MindIE's ``POST /infer_token`` (the request and answer shapes are dialects/mindie.py):
check the request against what is served, resolve its LoRA fields, send it through the engine
client (dialects/engine_client.py), answer in one JSON object or MindIE's events.
"""

from __future__ import annotations

from typing import AsyncIterator
import uuid

from fastapi.responses import StreamingResponse

from dialects import mindie
from dialects.engine_client import EngineClient, Generation, Origin
from dialects.openai_serving import SSE, as_api_error, raise_if_timed_out
from engine.lora_adapter import LoraRef, from_trtllm


class MindIEServing:
    """/infer_token on one ingress replica, over its engine client."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def infer_token(self, body: mindie.InferTokenRequest, origin: Origin):
        info, settings = await self.client.model_info(), self.client.settings
        try:
            limits = mindie.ServedLimits(info.vocab_size, info.max_iter_times + settings.prefill_made_tokens,
                                         settings.max_logits_floats, settings.max_beam_width, info.hidden_size,
                                         settings.max_draft_tokens)
            request = mindie.to_generation_request(body, f"infer-{uuid.uuid4().hex}",
                                                   origin.arrival + body.parameters.timeout, limits,
                                                   await self.lora(body.parameters))
        except ValueError as error:
            raise as_api_error(error) from None
        generation = await self.client.generate([request], origin)
        if body.stream:
            return StreamingResponse(self.events(generation, body), media_type=SSE)
        try:
            outputs = [output async for _, output in generation]
        finally:
            await generation.abort()  # on a cancelled request, cancels the engines' call at once
        raise_if_timed_out(outputs[-1])
        pad_id = body.parameters.pad_id if body.parameters.pad_id is not None else info.pad_token_id
        return mindie.text_response(outputs, body, pad_id)

    @staticmethod
    async def events(generation: Generation, body: mindie.InferTokenRequest) -> AsyncIterator[str]:
        """prefill_time: arrival to the first token; decode_time: since the previous token (the trace's clock)."""
        sent = []
        try:
            async for _, output in generation:
                sent.append(output)
                first = len(sent) == 1
                yield mindie.stream_event(sent, body, first,
                                          (generation.ttft_s if first else generation.last_gap_s) * 1000.0)
        except Exception as error:  # the stream has begun: end it with MindIE's last event, err_msg set
            yield mindie.error_event(sent, as_api_error(error).message)
        finally:
            await generation.abort()  # a client that went away cancels the engines' call at once

    async def lora(self, p: mindie.InferParameters) -> LoraRef | None:
        """The adapter /infer_token's LoRA fields name: a served name, a task id the app holds, or a
        task's weights sent now (checked here against the model, then held by the app)."""
        tensors = mindie.lora_tensors(p)
        if p.lora_name is not None:
            ref = (await self.client.lora_names()).get(p.lora_name)
            if ref is None:
                raise ValueError(f"parameters.lora_name: no adapter is named {p.lora_name!r} here (lora_modules)")
            return ref
        if p.lora_task_id is None:
            return None
        if not self.client.settings.serves_lora:
            raise ValueError("parameters.lora_task_id: this application serves no LoRA adapters (start it with "
                             "enable_lora=true)")
        if tensors is None:
            ref = await self.client.lora_task(p.lora_task_id)
            if ref is None:
                raise ValueError(f"parameters.lora_task_id: task {p.lora_task_id} is not cached; send lora_weights "
                                 "and lora_config with it")
            return ref
        shape = await self.client.lora_shape()
        try:
            adapter = from_trtllm(f"task-{p.lora_task_id}", *tensors, shape)
            adapter.check(shape, self.client.settings.max_lora_rank, "lora_weights")
        except ValueError as error:
            raise ValueError(f"parameters.{error}") from None
        return await self.client.put_lora_task(p.lora_task_id, adapter)
