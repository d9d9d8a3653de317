"""train: the project's own training loop around the speculators draft model of `train.method`
(train.methods: one module per method, EAGLE-3, P-EAGLE, DFlash, DFlash2, DSpark)."""
