"""The reports: one per variant (variant: report.md, an HTML summary and plots) and the
comparison of every variant (compare). Each rule's fingerprint holds its own modules and the
plotting they share (figures), so an edit to one report restales only its rule."""
