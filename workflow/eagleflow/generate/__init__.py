"""generate: the verifier's replies to the train prompts, through its OpenAI-compatible server.

The only stage that talks to the verifier. Every reply is kept in a response store keyed by
the request (and the server behaviour that answers it), never by eagleflow's code, so a fix
to how replies are parsed or assembled (the `synth` stage) costs no inference.
"""
