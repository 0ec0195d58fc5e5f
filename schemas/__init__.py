"""What every tokenbus process agrees on: wire messages, subjects, limits and the block hash."""
