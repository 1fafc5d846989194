"""One APIRouter per resource: OpenAI routes, runs, sessions."""
