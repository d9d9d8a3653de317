"""Result-side code every stage shares: atomic writes, typed config, content identities and
the keys of cached outputs, code fingerprints, request and reply formats, the server flags
that count. The code that only runs stages (the vLLM launcher, the chat client, the output
cache) is in runtime/."""
