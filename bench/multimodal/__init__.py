"""Images and routing: media-aware against media-blind routing on an agent-like image trace."""
