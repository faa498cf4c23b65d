"""The proxy front (`kvroute serve`): the FastAPI app, the uvicorn server and the
forwarding of a decided request to its pod."""
