"""flows package."""
