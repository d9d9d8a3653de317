"""Result-side code every stage shares: atomic writes, typed config, content identities and
the keys of cached outputs, code fingerprints, request and reply formats. The code that only
runs stages (the vLLM launcher, the reading of its server flags, the chat client, the output
cache) is in runtime/: the server flags that count reach the keys as data
(runtime/server_args.py)."""
