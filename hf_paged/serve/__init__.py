"""`hf-paged serve`: an OpenAI-compatible HTTP server on `hf_paged.Engine` (needs `pip install 'hf-paged[serve]'`).

    cli.py       command line: load the model, build the state, run uvicorn
    app.py       FastAPI routes, API key, OpenAI-style errors, the engine thread's lifetime
    handling.py  one HTTP request: checks, OpenAI fields -> generation fields + processors, collect or stream
    responses.py response objects and SSE chunks;  text.py  detokenization, stop strings, chat template
    worker.py    the engine's own thread and its bounded request queue;  metrics.py  Prometheus
    sampling.py  logit_bias, presence/frequency penalties;  json_mode.py  response_format json_object
"""
