"""Ray Serve deployment classes (Ingress, Denoiser, TP workers): thin shells over app/ and engine/.

Empty until the Ray Serve issue lands."""
