"""One package per wire protocol on the turn core: `openai` (chat completions, completions,
models), `responses` (OpenAI's Responses API), `anthropic` (Messages). Each holds its request
types, its adapter (request to a neutral turn, choices to JSON or events) and its routes; no
protocol imports another (what two share lives in `common` or the core)."""
