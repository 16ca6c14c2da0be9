"""The server on Ray Serve: N replicas of the engine behind Serve's proxy, each running our FastAPI app.

`config` (the `TTS_RAY_*` settings: replicas, autoscaling bounds, per-replica resources, backpressure),
`deployment` (the replica: one `tts_server` runtime + app as the Serve ingress; health from its engine),
`proxy` (Serve's own refusals put into our error shape), `cli` (`python -m tts_serve`: one machine or a
cluster). Only `config` imports without Ray; docs/deployment.md has the recipes.
"""
