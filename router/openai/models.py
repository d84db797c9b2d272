"""The models a caller can name: /v1/models and /v1/models/{id} (each LoRA adapter a model of its
own, as vLLM lists them), and vLLM's run-time LoRA admin, /v1/load_lora_adapter and
/v1/unload_lora_adapter: a load goes to the live workers that run with --enable-lora (of the
model the body names), an unload to those that serve the adapter."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
from aiohttp import web

from pagoda.protos.pagoda.v1 import pagoda_pb2 as pb
from pagoda.router.errors import RouterError
from pagoda.router.openai.request import ApiError, bad, json_body
from pagoda.router.openai.serving import Serving


class Models(Serving):
    async def models(self, request: web.Request) -> web.Response:
        try:
            self.identity(request)
            data = [await self._model_card(m) for m in self.service.cluster.models()]
        except ApiError as e:
            return e.response()
        # As vLLM lists them: each LoRA adapter a model of its own, its parent the base model.
        data += [self._adapter_card(name, base) for name, base in self.service.cluster.adapters().items()]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        """/v1/models/{id}: the model's card, or 404 naming it."""
        name = request.match_info["model"]
        try:
            self.identity(request)
            adapters = self.service.cluster.adapters()
            if name in adapters:
                return web.json_response(self._adapter_card(name, adapters[name]))
            if name not in self.service.cluster.models():
                raise ApiError(404, f"model: the model {name!r} does not exist", "model", "model_not_found")
            return web.json_response(await self._model_card(name))
        except ApiError as e:
            return e.response()

    def _adapter_card(self, name: str, base: str) -> dict:
        # As vLLM: root is where the adapter was read from (its name when no worker says).
        root = self.service.cluster.adapter_path(name) or name
        return {"id": name, "object": "model", "created": 0, "owned_by": "pagoda", "root": root, "parent": base}

    async def _model_card(self, model: str) -> dict:
        card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "pagoda",
                                "root": model, "parent": None}
        try:
            card["max_model_len"] = (await self.service.model_info(model)).max_model_len
        except RouterError:          # its workers went away meanwhile: the card without the figure
            pass
        return card

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter {lora_name, lora_path[, model]}: every live LoRA
        worker of the base model registers the adapter (its path must be readable on each); the
        answer names them. The same name and path again is a no-op on each worker."""
        return await self._lora_admin(request, load=True)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter {lora_name}: every live worker that serves it forgets it."""
        return await self._lora_admin(request, load=False)

    async def _lora_admin(self, request: web.Request, load: bool) -> web.Response:
        try:
            ident = self.identity(request)
            if ident is not None and not ident.admin:
                raise ApiError(403, "authorization: loading and unloading LoRA adapters needs an admin key",
                               code="permission_denied")
            body = await json_body(request)
            name, path, model = body.get("lora_name"), body.get("lora_path", ""), body.get("model")
            if not isinstance(name, str) or not name:
                raise bad("lora_name", "must be a non-empty string")
            if load and (not isinstance(path, str) or not path):
                raise bad("lora_path", "must be the adapter directory's path on the workers")
            if model is not None and not isinstance(model, str):
                raise bad("model", "must be a string")
            cluster = self.service.cluster
            workers = [w for w in cluster.workers.values() if model is None or w.lease.model == model]
            if not load:
                workers = [w for w in workers if name in w.lease.lora_adapters]
                if not workers:
                    raise ApiError(404, f"lora_name: no live worker serves {name!r}"
                                   + (f" (model {model!r})" if model else ""), "lora_name")
            else:
                workers = self._lora_targets(workers, model)
        except ApiError as e:
            return e.response()
        except ApiError as e:
            return e.response()

        async def one(w):
            admin = self.service.channels.admin(w.lease.address)
            meta = self.service.channels.metadata
            if load:
                return await admin.LoadLoRAAdapter(pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path),
                                                   timeout=60, metadata=meta)
            return await admin.UnloadLoRAAdapter(pb.UnloadLoRAAdapterRequest(lora_name=name), timeout=60,
                                                 metadata=meta)

        results = await asyncio.gather(*(one(w) for w in workers), return_exceptions=True)
        failed, done = [], []
        for w, r in zip(workers, results):
            if isinstance(r, grpc.aio.AioRpcError):
                failed.append(f"{w.name}: {r.details()}")
            elif isinstance(r, BaseException):
                raise r
            else:
                cluster.adapters_changed(w, list(r.adapters), (name, path) if load else None)
                done.append(w.name)
        verb = "added" if load else "removed"
        where = f"{'on' if load else 'from'} {', '.join(sorted(done))}"
        if failed:
            # The workers' messages start with the field at fault (lora_path for a bad directory).
            field = "lora_path" if load and failed[0].split(": ", 1)[1].startswith("lora_path") else "lora_name"
            return bad(field, f"{len(failed)} of {len(workers)} workers refused: " + "; ".join(failed)
                       + (f" ({verb} {where})" if done else "")).response()
        return web.Response(text=f"Success: LoRA adapter '{name}' {verb} successfully {where}.")

    def _lora_targets(self, workers: list, model: str | None) -> list:
        """The workers a load goes to: those of `model` that run with --enable-lora (a plain
        worker would only refuse it). Without `model`, their base model must be unambiguous: an
        adapter is trained for one base model."""
        targets = [w for w in workers if w.lease.max_loras > 0]
        if not workers:
            raise ApiError(404 if model else 503, f"model: no live worker of model {model!r}" if model
                           else "model: no live worker", "model", "model_not_found" if model else None)
        if not targets:
            raise bad("model", f"no live worker{f' of model {model!r}' if model else ''} runs with --enable-lora")
        bases = sorted({w.lease.model for w in targets})
        if len(bases) > 1:
            raise bad("model", f"workers of {', '.join(map(repr, bases))} serve LoRA adapters: name the base "
                               "model the adapter is for")
        return targets
