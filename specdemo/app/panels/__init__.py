"""Parts of the page that are not a tab: the lessons row above the tabs, and the step view under a run with the
recorded runs it replays."""
