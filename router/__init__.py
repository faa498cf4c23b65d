"""kvroute router: the OpenAI-compatible gateway process."""
