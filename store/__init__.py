"""The durable trajectory store (SQLAlchemy 2.0; SQLite by default, PostgreSQL by URL)."""
