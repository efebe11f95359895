"""The Triton Inference Server Python model that drives Linnet's engine (copied to `<repo>/<name>/1/model.py`).

Decoupled, like the vLLM Triton backend: inputs `text_input`, `max_tokens`, `stream`,
`sampling_parameters` (JSON); outputs `text_output` and `finish_reason`. `execute()` hands each
request to the engine and returns at once; the engine's deltas go through a queue to one response
thread, which sends them (every delta when streaming, the whole text at the end otherwise) and
cancels a request whose client has gone (`response_sender.is_cancelled()`; the engine asks it too
while the request waits for a row, so a cancelled request is dropped before its prefill). The
sampling parameters are read by the same code as `linnet serve`'s (serve/fields.py), and the engine is
configured by the same ServeConfig, from config.pbtxt's `linnet_*` parameters. `is_ready` is
the engine's health: Triton's model readiness turns false once a fault has stopped the engine
(python backends from 26.03 ask it; older ones report the stub's liveness only).
"""

from __future__ import annotations

import json
import queue
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from linnet_core.errors import InputError
from linnet_core.serve.config import ServeConfig

_DONE = object()


class TritonPythonModel:
    def initialize(self, args):
        from linnet_core.serve.fields import grammar_compiler, prompt_char_limit  # imports torch: not at start-up
        from linnet_core.serve.launch import launch  # imports torch: not at start-up

        model_config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        config = ServeConfig.from_parameters(params)  # every engine setting, as `linnet serve` takes it
        if config.model is None:
            raise InputError("config.pbtxt has no 'linnet_model' parameter (linnet export triton writes one)")
        served = launch(config)
        self.tokenizer = served.tokenizer
        self.engine = served.engine.start()
        self.compile_grammar = grammar_compiler(self.tokenizer, self.engine)
        try:  # here, on the stub's main thread: ml_dtypes (under xgrammar) fails to import on execute's
            import xgrammar  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure: structured output says why, the rest serves
            why = f"structured output is unavailable here: xgrammar did not import ({type(e).__name__}: {e})"

            def unavailable(spec, why=why):
                raise InputError(why)

            self.compile_grammar = unavailable
        self.max_prompt_chars = prompt_char_limit(served.session.cache_len)
        self.responses: queue.Queue = queue.Queue()
        self.live: dict[int, tuple] = {}  # handle id -> (handle, sender, stream, collected text)
        self.thread = threading.Thread(target=self._respond, name="linnet-triton-responses", daemon=True)
        self.thread.start()

    def is_ready(self):
        return self.engine.healthy and not self.engine.stopping

    def execute(self, requests):
        from linnet_core.serve.fields import generation_request, parse_json  # imports torch: not at start-up

        for request in requests:
            sender = request.get_response_sender()
            try:
                if self.tokenizer is None:
                    raise InputError("this model has no tokenizer, so it cannot take text")
                text = _first(request, "text_input")
                text = text.decode("utf-8", "replace") if isinstance(text, bytes) else str(text)
                if not text or len(text) > self.max_prompt_chars:
                    raise InputError(f"text_input must hold 1 to {self.max_prompt_chars} characters")
                raw = _first(request, "sampling_parameters", b"{}")
                fields = parse_json(raw or b"{}", "sampling_parameters")
                max_tokens = _first(request, "max_tokens", 16)  # sampling_parameters' max_tokens wins
                self.engine.check_capacity()  # before the text is tokenized
                gen = generation_request(fields, self.tokenizer.encode(text), default_max_tokens=int(max_tokens),
                                         max_tokens_limit=self.engine.cache_len,
                                         vocab_size=self.engine.session.vocab_size, default_temperature=0.0,
                                         text_only=True, compile_grammar=self.compile_grammar)
                handle = self.engine.submit(gen)
            except InputError as e:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(e.message)),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            handle.watch(sender.is_cancelled)
            self.live[handle.id] = (handle, sender, bool(_first(request, "stream", False)), [])
            handle.subscribe(lambda d, hid=handle.id: self.responses.put((hid, d)))
        return None  # decoupled: every response goes through its sender

    def _respond(self):
        while True:
            item = self.responses.get()
            if item is _DONE:
                return
            hid, delta = item
            handle, sender, stream, collected = self.live[hid]
            if delta.finish_reason is None and sender.is_cancelled():
                handle.cancel()  # the client has gone: free the row
                continue
            collected.append(delta.text)
            final = delta.finish_reason is not None
            if final and delta.finish_reason == "cancelled":
                when = ("before its prefill" if handle.stats.first_token is None
                        else f"after {handle.stats.completion_tokens} tokens")
                pb_utils.Logger.log_info(f"linnet: request {hid} cancelled by its client {when}; its row is freed")
            try:
                if final and handle.cancelled:
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # closes it, says nothing
                elif stream or final:
                    text = delta.text if stream else "".join(collected)
                    out = [pb_utils.Tensor("text_output", np.array([text.encode()], dtype=np.object_)),
                           pb_utils.Tensor("finish_reason", np.array([(delta.finish_reason or "").encode()],
                                                                     dtype=np.object_))]
                    sender.send(pb_utils.InferenceResponse(output_tensors=out),
                                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)
            except Exception as e:  # noqa: BLE001 - a send to a departed client fails; the thread goes on
                pb_utils.Logger.log_warn(f"linnet: response for request {hid} not sent: {e}")
                handle.cancel()
            if final:
                del self.live[hid]

    def finalize(self):
        self.engine.stop(timeout=10)
        self.responses.put(_DONE)
        self.thread.join(timeout=10)


_REQUIRED = object()


def _first(request, name: str, default=_REQUIRED):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if default is _REQUIRED:
            raise InputError(f"input '{name}' is required")
        return default
    values = tensor.as_numpy().reshape(-1)
    if values.size == 0:
        raise InputError(f"input '{name}' is empty")
    return values[0]
