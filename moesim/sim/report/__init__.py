"""Reports (`moesim report`): the figures (`plots`) and the page that selects and embeds them (`page`)."""
