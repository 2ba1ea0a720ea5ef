"""OpenAI's Responses API on the pagedq queue: `request` maps a body onto a chat request, `events`
renders the Response object and its streamed events, `store` keeps responses in Redis, `service`
serves the endpoints."""
